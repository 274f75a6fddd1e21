"""Adapter-only weight sync into vLLM (``--vllm_enable_lora``, engines/adapters.py for what is sent): colocate
(``VllmAdapterVersions``) and the rollout server (``ServedVllmAdapters``).

vLLM starts with LoRA enabled (``enable_lora``, ``max_lora_rank`` = ``--vllm_max_lora_rank``, ``max_loras`` = the
versions kept). The frozen base goes through the engine's ordinary in-place load once (and again when it changed);
each sync then writes the adapter as a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``, in the
engine's dtype) under a temporary folder of its own and loads it as a new ``LoRARequest`` named ``grpokit-v<N>``
with id N: vLLM keys its prefix cache by adapter, so a new name and id per version means no prefix computed under
one version is reused under another. Every generate call names the newest version; the versions beyond ``keep``
(``--max_staleness`` + 1) are removed, oldest first (colocate generate calls finish before a sync begins, so no
rollout still samples them). The weight check reads the written folder back (every factor there, with the sums the
trainer sent) and the logprob probe then samples the new version.

The rollout server's vLLM engine takes the same versions from the weight group (``ServedVllmAdapters``, staged and
checked as the transformers engine's, engines/adapter_store.py): vLLM starts with ``max_loras`` =
``--vllm_max_loras``, an update asking to keep more versions is refused before any bytes move, each committed
version is written and loaded under a name and id never used before, a request samples the version it names (the
newest where it names none), and a version beyond ``keep`` is removed once no request holds it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from collections import OrderedDict, deque
from pathlib import Path

import torch

from grpokit.engines.adapter_store import AdapterStaging
from grpokit.engines.adapters import (
    AdapterSpec,
    AdapterSync,
    adapter_module,
    adapter_tensors,
    base_fingerprint,
    base_tensors,
)
from grpokit.engines.sync_check.checksums import StreamTap, SyncReport, check_stream
from grpokit.errors import ConfigError, RolloutError, ServerError
from grpokit.wire.checksum import tensor_sums
from grpokit.wire.weights import dtype_name, parse_dtype

ADAPTER_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def write_adapter(folder: Path, spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` (wire names, engine dtype) as a PEFT adapter folder vLLM loads."""
    from safetensors.torch import save_file  # with transformers, always present; not at the top: a rare path

    folder.mkdir(parents=True)
    targets = sorted({adapter_module(n).rsplit(".", 1)[-1] for n in tensors})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.r,
        "lora_alpha": spec.lora_alpha,
        "use_rslora": spec.use_rslora,
        "target_modules": targets,
        "bias": "none",
        "lora_dropout": 0.0,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file({_PEFT_PREFIX + n: t.contiguous() for n, t in tensors.items()}, str(folder / ADAPTER_FILE))


def read_back(folder: Path) -> tuple[list[str], dict[str, tuple[list[float], str]]]:
    """The wire names the written adapter holds, and each one's sums (the weight check's 'held')."""
    from safetensors import safe_open  # with transformers, always present; not at the top: a rare path

    held = {}
    with safe_open(str(folder / ADAPTER_FILE), framework="pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            held[key.removeprefix(_PEFT_PREFIX)] = (tensor_sums(t).tolist(), dtype_name(t.dtype))
    return list(held), held


class VllmAdapterVersions:
    """The engine's LoRA versions: the base it holds, the folders written, the requests loaded. ``sync`` None:
    the engine serves no adapter (every sync merged)."""

    def __init__(self, sync: AdapterSync | None, dtype: torch.dtype, llm_kwargs: dict) -> None:
        """``llm_kwargs``: what ``vllm.LLM`` will be built with, given vLLM's LoRA options where ``sync`` is set."""
        self.sync, self.dtype = sync, dtype
        if sync is not None:
            llm_kwargs.update(enable_lora=True, max_lora_rank=sync.max_rank, max_loras=sync.keep)
        self._root: Path | None = None  # made at the first version, removed with this object
        self.base_held: str | None = None  # base_fingerprint of the base loaded into vLLM; None: the folder's
        self.loaded: deque = deque()  # LoRARequests, oldest first
        self.version = 0
        self.last_sync_bytes = 0  # what the last adapter sync moved into vLLM (the base included when it went)

    @property
    def current(self):
        """The LoRARequest every generate call names (None: merged weights, no adapter)."""
        return self.loaded[-1] if self.loaded else None

    def needs_base(self, model) -> bool:
        return self.base_held != base_fingerprint(model)

    def based_on(self, model) -> None:
        self.base_held = base_fingerprint(model)

    def new_version(self, model, spec: AdapterSpec, llm) -> SyncReport:
        """Write the next version, check the folder holds every factor sent with its sums (WeightSyncError naming
        the first that does not), then load it; the check's report."""
        from vllm.lora.request import LoRARequest  # vLLM is imported only where it serves

        tap = StreamTap(adapter_tensors(model), self.dtype)
        self.version += 1
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="grpokit-vllm-lora-"))
            weakref.finalize(self, shutil.rmtree, self._root, True)
        folder = self._root / f"v{self.version}"
        tensors = {n: t.to(self.dtype) for n, t in tap}
        write_adapter(folder, spec, tensors)
        self.last_sync_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        report = check_stream(tap, *read_back(folder), "vLLM's LoRA adapter")
        request = LoRARequest(f"grpokit-v{self.version}", self.version, str(folder))
        try:
            llm.llm_engine.add_lora(request)
        except (ValueError, RuntimeError, KeyError, TypeError) as e:
            raise RolloutError(f"vLLM could not load LoRA version {self.version}: {e}") from e
        self.loaded.append(request)
        self._unload(llm, keep=self.sync.keep)
        return report

    def merged(self, llm) -> None:
        """A merged sync replaced the weights: no version is served any more (nor is the base known)."""
        self._unload(llm, keep=0)
        self.base_held = None

    def _unload(self, llm, keep: int) -> None:
        """Remove the oldest versions from vLLM (and their folders) until ``keep`` are left."""
        while len(self.loaded) > keep:
            old = self.loaded.popleft()
            llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)


class ServedVllmAdapters(AdapterStaging):
    """The rollout server's LoRA versions in vLLM (``engine``: its ``ServedVllmEngine``, started with LoRA): each
    committed version a PEFT folder loaded as a ``LoRARequest`` of a name and id of its own."""

    def __init__(self, engine, max_rank: int, max_loras: int) -> None:
        super().__init__(max_rank)
        self.engine, self.max_loras = engine, max_loras
        self.requests: OrderedDict[int, object] = OrderedDict()  # version -> LoRARequest, oldest first
        self._replaced: list[tuple[int, object]] = []  # a version synced again: its old request, until released
        self._serial = 0  # every LoRARequest's id and name: never reused
        self._root = Path(tempfile.mkdtemp(prefix="grpokit-vllm-lora-"))
        weakref.finalize(self, shutil.rmtree, self._root, True)

    @property
    def loaded(self) -> list[int]:
        return list(self.requests)

    def layer_shape(self, module: str) -> tuple[int, ...] | None:
        known = self.engine._hf_shapes().get(module + ".weight")
        return None if known is None else tuple(known[0])

    def factor_place(self, name: str) -> tuple[torch.device, torch.dtype]:
        return torch.device("cpu"), self.engine.dtype  # written to the version's folder in the engine's dtype

    def refusal(self, keep: int) -> str | None:
        if keep <= self.max_loras:
            return None
        return (
            f"the trainer keeps {keep} LoRA versions loaded (--max_staleness {keep - 1}) and this server loads at "
            f"most {self.max_loras}: start grpokit rollout with --vllm_max_loras {keep} or more"
        )

    def request(self, version: int | None):
        """The LoRARequest of ``version`` (None: the newest; None where no version is loaded)."""
        if version is None:
            return self.requests[self.latest] if self.requests else None
        request = self.requests.get(version)
        if request is None:
            raise ConfigError(f"weight_version {version}: not loaded on this server (loaded: {self.loaded or 'none'})")
        return request

    def _store(self, staged: dict, factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        from vllm.lora.request import LoRARequest  # vLLM is imported only where it serves

        version, self._serial = staged["version"], self._serial + 1
        folder = self._root / f"v{version}-{self._serial}"
        tensors = {f"{m}.lora_{x}.weight": t for m, pair in factors.items() for x, t in zip("AB", pair, strict=True)}
        write_adapter(folder, staged["spec"], tensors)
        request = LoRARequest(f"grpokit-v{version}-{self._serial}", self._serial, str(folder))
        try:
            self.engine._run(self.engine.llm.llm_engine.add_lora, request)
        except (ValueError, RuntimeError, KeyError, TypeError) as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise ServerError(f"vLLM could not load LoRA version {version}: {str(e).splitlines()[0][:200]}") from e
        with self._held_lock:
            old = self.requests.pop(version, None)
            self.requests[version] = request
            if old is not None:
                self._replaced.append((version, old))

    def _unload(self, versions: list[int]) -> list:
        dropped = [self.requests.pop(v) for v in versions]
        done = [r for v, r in self._replaced if not self._in_use(v)]
        self._replaced = [(v, r) for v, r in self._replaced if self._in_use(v)]
        return dropped + done

    def _cleanup(self, dropped: list) -> None:
        """Remove the requests from vLLM and their folders, on the vLLM thread once it is free (not waited for:
        a release on the server's event loop must not wait for a batch)."""

        def remove() -> None:
            for request in dropped:
                self.engine.llm.llm_engine.remove_lora(request.lora_int_id)
                shutil.rmtree(request.lora_path, ignore_errors=True)

        if dropped:
            self.engine._executor.submit(remove)

    def forget(self) -> None:
        """A merged update replaced the weights: no version is served any more, nor is the base known."""
        self._staged = None
        with self._held_lock:
            dropped = list(self.requests.values()) + [r for _, r in self._replaced]
            self.requests.clear()
            self._replaced = []
            self.base_id = None
        self._cleanup(dropped)

    def held_sums(self, names: list[str]) -> dict:
        """The weight check's adapter part: name -> (sums, dtype) of each factor of the newest version, read back
        from the folder vLLM loaded it from; names it does not hold are left out."""
        if not self.requests:
            return {}
        _, held = read_back(Path(self.requests[self.latest].lora_path))
        return {n: (held[n][0], parse_dtype(held[n][1])) for n in names if n in held}


def sync_adapter(engine, model, checked: bool) -> SyncReport | None:
    """An adapter-only sync of ``engine`` (a VllmEngine serving LoRA) to ``model``: the base first where vLLM does
    not hold it, then the adapter as a new version. None: this sync is merged (the adapter cannot be served
    unmerged, said once; the versions loaded so far are dropped). The adapter's folder is checked either way (a
    lost factor must not reach vLLM); ``checked``: the base's load is checked too."""
    versions = engine.adapter_versions
    if versions.sync is None:
        return None
    spec = versions.sync.plan(model)
    if spec is None:
        with engine.lock:
            engine._run(versions.merged, engine.llm)
        return None
    report, versions.last_sync_bytes = SyncReport(), 0
    with engine.lock:
        engine._wake(["weights"])  # sleep level 2 dropped the base: it goes again
        if versions.needs_base(model) or engine._weights_dropped:
            versions.last_sync_bytes = sum(t.numel() * t.element_size() for _, t in base_tensors(model))
            base = base_tensors(model)
            report = engine._checked(base) if checked else SyncReport(len(engine._sync(base)))
            versions.based_on(model)
        adapter = engine._run(versions.new_version, model, spec, engine.llm)
        engine.reset_prefix_cache()
    return SyncReport(report.checked + adapter.checked, report.unreadable, report.seconds + adapter.seconds)
