"""Adapter-only weight sync, the engine's side, for an engine that holds a plain Hugging Face model (the rollout
server's transformers engine): LoRA versions held side by side over one base.

Each adapter sync is staged (``begin``, ``load``), then checked and committed as a new version (``commit``): a
version whose factors are missing or of the wrong shape is refused, naming the tensor, and the one in service stays.
The served weights of a LoRA layer are ``base + scale * B @ A`` of the version being sampled, computed from a
pristine copy of the base (never by adding and subtracting deltas, so no rounding builds up): the same value the
trainer's merged sync sends. ``keep`` versions stay loaded (``--max_staleness K`` keeps K + 1); an older one is
unloaded only once no rollout holds it (``hold``/``release``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from grpokit.engines.adapters import adapter_module, is_adapter_name
from grpokit.errors import ServerError

LOADED_BASE = "served-model"  # the base an engine starts with: the model it loaded (ms-swift's adapters apply to it)


@dataclass
class AdapterVersion:
    version: int
    scale: float
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], B [out, r])


class AdapterVersions:
    """LoRA versions over the parameters ``params`` (name -> parameter) of a served model. Callers hold the
    engine's lock around ``begin``..``commit`` and ``activate``."""

    def __init__(self, params: dict[str, torch.nn.Parameter], max_rank: int = 64) -> None:
        self.params = params
        self.max_rank = max_rank
        self.base: dict[str, torch.Tensor] = {}  # module -> pristine base weight of each LoRA layer
        self.base_id: str | None = LOADED_BASE  # the trainer's name for the base held; None: merged weights came
        self.versions: OrderedDict[int, AdapterVersion] = OrderedDict()
        self.active: int | None = None
        self.keep = 1
        self._holders: dict[int, int] = {}
        self._held_lock = threading.Lock()
        self._staged: dict | None = None

    @property
    def staging(self) -> bool:
        """An adapter update is being received (``begin`` ran, ``commit`` or ``abort`` not yet)."""
        return self._staged is not None

    def abort(self) -> None:
        """The update being staged failed to arrive: the version in service goes back."""
        staged, self._staged = self._staged, None
        if staged is not None:
            self.activate(staged["prev"])

    @property
    def latest(self) -> int | None:
        return next(reversed(self.versions), None)

    # -- receiving -------------------------------------------------------------------------------------------------
    def check(self, name: str, shape: list[int]) -> str | None:
        """The problem with loading LoRA factor ``name`` of ``shape``, or None."""
        weight = self.params.get(adapter_module(name) + ".weight")
        if weight is None or weight.dim() != 2:
            return f"{name}: no linear layer {adapter_module(name)!r} in the served model"
        if len(shape) != 2:
            return f"{name}: shape {shape} is not a matrix"
        r = shape[0] if ".lora_A." in name else shape[1]
        want = [r, weight.shape[1]] if ".lora_A." in name else [weight.shape[0], r]
        if list(shape) != want:
            return f"{name}: shape {shape} but the layer takes {want}"
        if r > self.max_rank:
            return f"{name}: rank {r} is above this engine's --vllm_max_lora_rank {self.max_rank}"
        return None

    def begin(self, version: int, scale: float, base_id: str, keep: int, names: list[str]) -> None:
        """Stage a new version of the factors ``names`` announced; the served LoRA layers go back to their base so
        that base tensors load clean."""
        prev = self.active
        self._restore_base()
        self.keep = max(1, keep)
        expected = [n for n in names if is_adapter_name(n)]
        self._staged = {
            "version": version,
            "scale": scale,
            "base_id": base_id,
            "factors": {},
            "base": False,
            "expected": expected,
            "prev": prev,
        }

    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Tensors of the update being staged: LoRA factors are kept (copied: the buffer is reused), base weights
        go into the parameters."""
        staged = self._staged
        for name, tensor in named:
            if is_adapter_name(name):
                param = self.params[adapter_module(name) + ".weight"]
                staged["factors"][name] = tensor.to(device=param.device, dtype=param.dtype, copy=True)
            else:
                self.params[name].data.copy_(tensor, non_blocking=True)
                staged["base"] = True

    def commit(self) -> int:
        """The staged version checked whole, kept and put in service; its number. ServerError naming the first
        missing factor (the staged update is dropped, the version in service put back)."""
        staged, self._staged = self._staged, None
        if staged["base"] is False and staged["base_id"] != self.base_id:
            self.activate(staged["prev"])
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
            self.activate(staged["prev"])
            raise ServerError(f"adapter update: {missing[0]} did not arrive ({len(missing)} missing in all)")
        factors = {
            m: (names[f"{m}.lora_A.weight"], names[f"{m}.lora_B.weight"])
            for m in sorted({adapter_module(n) for n in names})
        }
        if staged["base"]:
            self.base = {m: self.params[m + ".weight"].detach().clone() for m in factors}
            self.base_id = staged["base_id"]
        for module in factors.keys() - self.base.keys():
            self.base[module] = self.params[module + ".weight"].detach().clone()
        version = AdapterVersion(staged["version"], staged["scale"], factors)
        self.versions.pop(version.version, None)
        self.versions[version.version] = version
        self.activate(version.version)
        self._evict()
        return version.version

    def forget(self) -> None:
        """A merged update replaces the weights: no version, no base copy (the parameters hold what came)."""
        self._staged = None
        self.base, self.base_id, self.active = {}, None, None
        self.versions.clear()

    # -- serving ---------------------------------------------------------------------------------------------------
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

    def _evict(self) -> None:
        """Unload the oldest versions beyond ``keep``, skipping (for now) any a rollout still holds."""
        with self._held_lock:
            for version in list(self.versions)[: max(0, len(self.versions) - self.keep)]:
                if version != self.active and not self._holders.get(version):
                    del self.versions[version]

    def _restore_base(self) -> None:
        with torch.no_grad():
            for module, base in self.base.items():
                self.params[module + ".weight"].data.copy_(base)
        self.active = None

    # -- the weight check ------------------------------------------------------------------------------------------
    def held(self, name: str) -> torch.Tensor | None:
        """What the engine holds under a wire name: a LoRA factor of the version in service, the pristine base of
        a LoRA layer, or None (a plain parameter: read it from the model)."""
        if is_adapter_name(name):
            version = self.versions.get(self.active) if self.active is not None else None
            factors = version.factors.get(adapter_module(name)) if version is not None else None
            if factors is None:
                return None
            return factors[0] if ".lora_A." in name else factors[1]
        if name.endswith(".weight") and name[: -len(".weight")] in self.base:
            return self.base[name[: -len(".weight")]]
        return None


__all__ = ["AdapterVersion", "AdapterVersions"]
