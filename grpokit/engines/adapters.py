"""Adapter-only weight sync, the trainer's side: which LoRA models can be served unmerged, and what to send.

With ``--vllm_enable_lora true`` and ``--tuner_type lora``, a sync sends the engine only the LoRA factors (every
layer's ``lora_A`` and ``lora_B``, under PEFT's saved-adapter names without the adapter's name, e.g.
``model.layers.0.self_attn.q_proj.lora_A.weight``) and the adapter's scale; the engine serves base weight +
``scale * B @ A``. The frozen base goes once: on the first sync, and again whenever it changed (torch's in-place
version counters of the base parameters) or the engine no longer holds this trainer's base. Where the adapter is
more than a low-rank delta per linear layer (DoRA, ``modules_to_save``, LoRA biases, embedding LoRA, per-module
rank or alpha), has a rank above ``--vllm_max_lora_rank``, or the model is sharded, the sync stays merged and says
why once (``AdapterSync.plan``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from grpokit.engines.weights import gathers_on_every_rank, is_peft_model, named_sync_tensors, plain_name

logger = logging.getLogger(__name__)

_PEFT_PREFIX = "base_model.model."
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter_name(name: str) -> bool:
    """A LoRA factor's wire name (``<module>.lora_A.weight`` / ``<module>.lora_B.weight``)."""
    return name.endswith(LORA_SUFFIXES)


def adapter_module(name: str) -> str:
    """The plain name of the linear layer a LoRA factor belongs to (``model.layers.0.mlp.up_proj``)."""
    return name.rsplit(".lora_", 1)[0]


def lora_scale(r: int, lora_alpha: float, use_rslora: bool) -> float:
    """PEFT's scaling of ``B @ A``: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r


def _lora_modules(model) -> Iterator[tuple[str, torch.nn.Module]]:
    from peft.tuners.lora import LoraLayer  # peft is present whenever a model has adapters: not at the top

    for prefix, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield prefix, module


def unmerged_reason(model, max_rank: int) -> str | None:
    """Why ``model``'s adapter cannot be served unmerged (then the sync sends merged weights), or None."""
    if not is_peft_model(model):
        return "the model has no LoRA adapter (--tuner_type full)"
    active = list(getattr(model, "active_adapters", None) or [model.active_adapter])
    if len(active) != 1:
        return f"{len(active)} active adapters (adapter-only sync serves one)"
    cfg = model.peft_config[active[0]]
    if str(getattr(cfg, "peft_type", "")).split(".")[-1] != "LORA":
        return f"a {cfg.peft_type} adapter (adapter-only sync serves LoRA)"
    if getattr(cfg, "use_dora", False):
        return "DoRA (its magnitude vector is more than a low-rank delta)"
    if getattr(cfg, "modules_to_save", None):
        return f"modules_to_save {list(cfg.modules_to_save)} (whole trained copies of those modules)"
    if getattr(cfg, "lora_bias", False):
        return "lora_bias (a trained bias is more than a low-rank delta)"
    if getattr(cfg, "rank_pattern", None) or getattr(cfg, "alpha_pattern", None):
        return "a per-module rank_pattern/alpha_pattern"
    if cfg.r > max_rank:
        return f"LoRA rank {cfg.r} is above --vllm_max_lora_rank {max_rank} (raise it to at least {cfg.r})"
    if gathers_on_every_rank(model):
        return "the model is sharded (FSDP2/ZeRO-3)"
    for name, module in _lora_modules(model):
        if not isinstance(module.get_base_layer(), torch.nn.Linear) or getattr(module, "fan_in_fan_out", False):
            return f"{plain_name(name + '.weight')}: LoRA on a {type(module.get_base_layer()).__name__} layer"
    return None


@dataclass(frozen=True)
class AdapterSpec:
    """What the engine needs besides the factors: the scale (from r, alpha, rsLoRA) and the base's identity."""

    r: int
    lora_alpha: float
    use_rslora: bool

    @classmethod
    def of(cls, model) -> AdapterSpec:
        cfg = model.peft_config[model.active_adapter]
        return cls(r=int(cfg.r), lora_alpha=float(cfg.lora_alpha), use_rslora=bool(getattr(cfg, "use_rslora", False)))

    @property
    def scale(self) -> float:
        return lora_scale(self.r, self.lora_alpha, self.use_rslora)


def adapter_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(wire name, tensor) of every LoRA factor of the active adapter, in the model's order (detached, as stored)."""
    adapter = model.active_adapter
    for prefix, module in _lora_modules(model):
        plain = plain_name(prefix + ".weight")[: -len(".weight")]
        yield f"{plain}.lora_A.weight", module.lora_A[adapter].weight.detach()
        yield f"{plain}.lora_B.weight", module.lora_B[adapter].weight.detach()


def base_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(plain name, tensor) of the frozen base weights, unmerged (the model's own storage: read before the next)."""
    for name, param in named_sync_tensors(model):
        yield name, param.detach()


def base_fingerprint(model) -> str:
    """Changes whenever a base weight is written in place (torch's version counters) or replaced."""
    h = hashlib.sha256()
    for name, param in named_sync_tensors(model):
        h.update(f"{name}:{id(param)}:{param._version};".encode())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class AdapterUpdate:
    """One adapter-only sync: the factors of ``spec``'s adapter, with the base weights first when ``base``."""

    spec: AdapterSpec
    base_id: str
    base: bool = True
    keep: int = 1  # versions the engine keeps loaded (--max_staleness + 1)

    def tensors(self, model) -> Iterator[tuple[str, torch.Tensor]]:
        if self.base:
            yield from base_tensors(model)
        yield from adapter_tensors(model)

    def body(self) -> dict:
        """``UpdateWeightsBody.adapter`` (grpokit/wire/bodies.py)."""
        return {**dataclasses.asdict(self.spec), "base_id": self.base_id, "base": self.base, "keep": self.keep}


class AdapterSync:
    """The per-engine decision and the base's bookkeeping: ``plan(model)`` says whether this sync is adapter-only
    (logging the fallback reason once), ``needs_base`` whether the base must go with it."""

    def __init__(self, enabled: bool, max_rank: int, engine: str, keep: int = 1) -> None:
        self.enabled, self.max_rank, self.engine, self.keep = enabled, max_rank, engine, keep
        self._said: set[str] = set()
        self._session = uuid.uuid4().hex  # told apart from another trainer's base with the same fingerprint

    @classmethod
    def for_run(cls, rollout, engine: str) -> AdapterSync:
        """A training run's, from its rollout options: ``--vllm_enable_lora``, ``--vllm_max_lora_rank``, and the
        versions the engine keeps loaded (``--max_staleness K``: K + 1, the oldest a window may sample)."""
        keep = 1 + (rollout.max_staleness or 0)
        return cls(rollout.vllm_enable_lora, rollout.vllm_max_lora_rank, engine, keep=keep)

    def plan(self, model, engine_reason: str | None = None) -> AdapterSpec | None:
        """The adapter to send alone, or None for a merged sync (why, logged once). ``engine_reason``: why the
        engine cannot serve LoRA (None: it can)."""
        if not self.enabled or not is_peft_model(model):
            return None
        reason = engine_reason or unmerged_reason(model, self.max_rank)
        if reason is not None:
            if reason not in self._said:
                self._said.add(reason)
                logger.warning("--vllm_enable_lora: %s syncs merged weights: %s", self.engine, reason)
            return None
        return AdapterSpec.of(model)

    def update(self, model, engine_reason: str | None = None) -> AdapterUpdate | None:
        """This sync's adapter update (the base included: the engine's dry-run answer may drop it), or None."""
        spec = self.plan(model, engine_reason)
        if spec is None:
            return None
        base_id = hashlib.sha256((self._session + base_fingerprint(model)).encode()).hexdigest()[:40]
        return AdapterUpdate(spec, base_id, base=True, keep=self.keep)


__all__ = [
    "AdapterSpec",
    "AdapterUpdate",
    "AdapterSync",
    "adapter_module",
    "adapter_tensors",
    "base_tensors",
    "is_adapter_name",
    "lora_scale",
    "unmerged_reason",
]
