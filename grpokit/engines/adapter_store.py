"""Adapter-only weight sync, the engine's side: LoRA versions held side by side over one base, in a rollout server.

``AdapterStaging`` is what every served engine shares: each adapter sync is staged (``begin``, ``load``), then
checked and committed as a new version (``commit``): a version whose factors are missing or of the wrong shape is
refused, naming the tensor, and the one in service stays. ``keep`` versions stay loaded (``--max_staleness K``
keeps K + 1); an older one is unloaded only once no rollout holds it (``hold``/``release``; a request naming its
version holds it from the moment it is admitted, ``hold_loaded``). The weight check reads the newest version.

``AdapterVersions`` serves them from a plain Hugging Face model (the transformers engine): the weights of a LoRA
layer are ``base + scale * B @ A`` of the version being sampled, computed from a pristine copy of the base (never
by adding and subtracting deltas, so no rounding builds up): the same value the trainer's merged sync sends. The
vLLM engine's are LoRA requests (engines/vllm_adapters.py, ``ServedVllmAdapters``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from grpokit.engines.adapters import AdapterSpec, adapter_module, is_adapter_name
from grpokit.errors import ConfigError, ServerError

LOADED_BASE = "served-model"  # the base an engine starts with: the model it loaded (ms-swift's adapters apply to it)


@dataclass
class AdapterVersion:
    version: int
    scale: float
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], B [out, r])


class AdapterStaging:
    """The staging, the completeness check and the holds of a served engine's LoRA versions. A subclass says the
    shape of a linear layer (``layer_shape``), where a factor is kept (``factor_place``), and what a version is
    (``_store``, ``_unload``, ``_put_back``, ``loaded``)."""

    def __init__(self, max_rank: int) -> None:
        self.max_rank = max_rank
        self.base_id: str | None = LOADED_BASE  # the trainer's name for the base held; None: merged weights came
        self.keep = 1
        self._holders: dict[int, int] = {}
        self._held_lock = threading.Lock()
        self._staged: dict | None = None

    # -- what a subclass says ------------------------------------------------------------------------------------
    def layer_shape(self, module: str) -> tuple[int, ...] | None:
        raise NotImplementedError

    def factor_place(self, name: str) -> tuple[torch.device, torch.dtype]:
        raise NotImplementedError

    @property
    def loaded(self) -> list[int]:
        """The versions loaded, oldest first."""
        raise NotImplementedError

    def _store(self, staged: dict, factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        raise NotImplementedError

    def _unload(self, versions: list[int]) -> list:
        """Drop ``versions`` from the bookkeeping (called under the holds' lock: quick); what ``_cleanup`` frees."""
        raise NotImplementedError

    def _cleanup(self, dropped: list) -> None:
        """Free what ``_unload`` dropped (outside the holds' lock: it may wait for the engine)."""

    def _put_back(self, prev: int | None) -> None:
        """A staged update was dropped: the version in service before it goes back."""

    @property
    def latest(self) -> int | None:
        return self.loaded[-1] if self.loaded else None

    @property
    def staging(self) -> bool:
        """An adapter update is being received (``begin`` ran, ``commit`` or ``abort`` not yet)."""
        return self._staged is not None

    def refusal(self, keep: int) -> str | None:
        """Why an update asking to keep ``keep`` versions cannot be served (None: it can)."""
        return None

    # -- receiving -------------------------------------------------------------------------------------------------
    def check(self, name: str, shape: list[int]) -> str | None:
        """The problem with loading LoRA factor ``name`` of ``shape``, or None."""
        weight = self.layer_shape(adapter_module(name))
        if weight is None or len(weight) != 2:
            return f"{name}: no linear layer {adapter_module(name)!r} in the served model"
        if len(shape) != 2:
            return f"{name}: shape {shape} is not a matrix"
        r = shape[0] if ".lora_A." in name else shape[1]
        want = [r, weight[1]] if ".lora_A." in name else [weight[0], r]
        if list(shape) != want:
            return f"{name}: shape {shape} but the layer takes {want}"
        if r > self.max_rank:
            return f"{name}: rank {r} is above this engine's --vllm_max_lora_rank {self.max_rank}"
        return None

    def begin(self, version: int, spec: AdapterSpec, base_id: str, keep: int, names: list[str], prev=None) -> None:
        """Stage a new version of the factors ``names`` announced (``prev``: the version to put back on failure)."""
        self.keep = max(1, keep)
        expected = [n for n in names if is_adapter_name(n)]
        self._staged = {
            "version": version,
            "spec": spec,
            "base_id": base_id,
            "factors": {},
            "base": False,
            "expected": expected,
            "prev": prev,
        }

    def load(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Tensors of the update being staged: LoRA factors are kept (copied: the buffer is reused); the base
        weights among them are returned, for the engine's ordinary load."""
        staged, base = self._staged, []
        for name, tensor in named:
            if is_adapter_name(name):
                device, dtype = self.factor_place(name)
                staged["factors"][name] = tensor.to(device=device, dtype=dtype, copy=True)
            else:
                base.append((name, tensor))
                staged["base"] = True
        return base

    def abort(self) -> None:
        """The update being staged failed to arrive: the version in service goes back."""
        staged, self._staged = self._staged, None
        if staged is not None:
            self._put_back(staged["prev"])

    def commit(self) -> int:
        """The staged version checked whole, kept and put in service; its number. ServerError naming the first
        missing factor (the staged update is dropped, the version in service put back)."""
        staged, self._staged = self._staged, None
        if staged["base"] is False and staged["base_id"] != self.base_id:
            self._put_back(staged["prev"])
            raise ServerError("adapter update without the base weights it was trained on: the trainer sends them")
        names = staged["factors"]
        missing = [n for n in staged["expected"] if n not in names]
        missing += [
            f"{m}.lora_{x}.weight"
            for m in {adapter_module(n) for n in names}
            for x in "AB"
            if f"{m}.lora_{x}.weight" not in names
        ]
        if missing:
            self._put_back(staged["prev"])
            raise ServerError(f"adapter update: {missing[0]} did not arrive ({len(missing)} missing in all)")
        factors = {
            m: (names[f"{m}.lora_A.weight"], names[f"{m}.lora_B.weight"])
            for m in sorted({adapter_module(n) for n in names})
        }
        if staged["base"]:
            self.base_id = staged["base_id"]
        self._store(staged, factors)
        self._evict()
        return staged["version"]

    # -- holds -----------------------------------------------------------------------------------------------------
    def hold_loaded(self, version: int) -> None:
        """A request naming ``version`` was admitted: it stays loaded until ``release``. ConfigError (answered 400)
        naming it and the loaded ones where it is not loaded."""
        with self._held_lock:
            if version not in self.loaded:
                raise ConfigError(
                    f"weight_version {version}: not loaded on this server (loaded: {self.loaded or 'none'}); "
                    "leave it unset to sample the newest"
                )
            self._holders[version] = self._holders.get(version, 0) + 1

    def hold(self, version: int | None) -> None:
        """A rollout samples ``version``: it stays loaded until ``release``."""
        if version is not None:
            with self._held_lock:
                self._holders[version] = self._holders.get(version, 0) + 1

    def release(self, version: int | None) -> None:
        if version is None:
            return
        with self._held_lock:
            left = self._holders.get(version, 0) - 1
            if left > 0:
                self._holders[version] = left
            else:
                self._holders.pop(version, None)
        self._evict()

    def _in_use(self, version: int) -> bool:
        return bool(self._holders.get(version))

    def _evict(self) -> None:
        """Unload the oldest versions beyond ``keep``, skipping (for now) any a rollout still holds."""
        with self._held_lock:
            loaded = self.loaded
            gone = [v for v in loaded[: max(0, len(loaded) - self.keep)] if not self._in_use(v)]
            dropped = self._unload(gone)  # a subclass may drop more (a version synced again, now released)
        if dropped:
            self._cleanup(dropped)


class AdapterVersions(AdapterStaging):
    """LoRA versions over the parameters ``params`` (name -> parameter) of a served model. Callers hold the
    engine's lock around ``begin``..``commit`` and ``activate``."""

    def __init__(self, params: dict[str, torch.nn.Parameter], max_rank: int = 64) -> None:
        super().__init__(max_rank)
        self.params = params
        self.base: dict[str, torch.Tensor] = {}  # module -> pristine base weight of each LoRA layer
        self.versions: OrderedDict[int, AdapterVersion] = OrderedDict()
        self.active: int | None = None

    @property
    def loaded(self) -> list[int]:
        return list(self.versions)

    def layer_shape(self, module: str) -> tuple[int, ...] | None:
        weight = self.params.get(module + ".weight")
        return None if weight is None else tuple(weight.shape)

    def factor_place(self, name: str) -> tuple[torch.device, torch.dtype]:
        param = self.params[adapter_module(name) + ".weight"]
        return param.device, param.dtype

    def begin(self, version: int, spec: AdapterSpec, base_id: str, keep: int, names: list[str], prev=None) -> None:
        """As ``AdapterStaging.begin``; the served LoRA layers go back to their base so that base tensors load
        clean."""
        prev = self.active
        self._restore_base()
        super().begin(version, spec, base_id, keep, names, prev)

    @torch.no_grad()
    def load(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """As ``AdapterStaging.load``, the base weights copied into the parameters here (nothing returned)."""
        for name, tensor in super().load(named):
            self.params[name].data.copy_(tensor, non_blocking=True)
        return []

    def _put_back(self, prev: int | None) -> None:
        self.activate(prev)

    def _store(self, staged: dict, factors: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        if staged["base"]:
            self.base = {m: self.params[m + ".weight"].detach().clone() for m in factors}
        for module in factors.keys() - self.base.keys():
            self.base[module] = self.params[module + ".weight"].detach().clone()
        version = AdapterVersion(staged["version"], staged["spec"].scale, factors)
        self.versions.pop(version.version, None)
        self.versions[version.version] = version
        self.activate(version.version)

    def forget(self) -> None:
        """A merged update replaces the weights: no version, no base copy (the parameters hold what came)."""
        self._staged = None
        self.base, self.base_id, self.active = {}, None, None
        self.versions.clear()

    @torch.no_grad()
    def activate(self, version: int | None) -> None:
        """Serve ``version`` (its layers as base + scale * B @ A); None: the base alone."""
        if version == self.active and self._staged is None:
            return
        held = self.versions.get(version) if version is not None else None
        if version is not None and held is None:
            raise ServerError(f"weight version {version} is not loaded (loaded: {list(self.versions)})")
        for module, base in self.base.items():
            weight = self.params[module + ".weight"]
            weight.data.copy_(base)
            if held is not None and module in held.factors:
                a, b = held.factors[module]
                weight.data.add_((b @ a) * held.scale)  # as peft's merge: delta computed, then added
        self.active = version

    def _in_use(self, version: int) -> bool:
        return version == self.active or super()._in_use(version)

    def _unload(self, versions: list[int]) -> list:
        for version in versions:
            del self.versions[version]
        return []

    def _restore_base(self) -> None:
        with torch.no_grad():
            for module, base in self.base.items():
                self.params[module + ".weight"].data.copy_(base)
        self.active = None

    # -- the weight check ------------------------------------------------------------------------------------------
    def held(self, name: str) -> torch.Tensor | None:
        """What the engine holds under a wire name: a LoRA factor of the newest version (the last sync's), the
        pristine base of a LoRA layer, or None (a plain parameter: read it from the model)."""
        if is_adapter_name(name):
            version = self.versions.get(self.latest) if self.latest is not None else None
            factors = version.factors.get(adapter_module(name)) if version is not None else None
            if factors is None:
                return None
            return factors[0] if ".lora_A." in name else factors[1]
        if name.endswith(".weight") and name[: -len(".weight")] in self.base:
            return self.base[name[: -len(".weight")]]
        return None


__all__ = ["AdapterStaging", "AdapterVersion", "AdapterVersions"]
