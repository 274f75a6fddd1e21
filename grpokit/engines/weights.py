"""The weights an inference engine needs from a training model, under their plain Hugging Face names.

A plain model yields its parameters as they are. A peft LoRA model yields the *merged* weights
(``W + scale * B @ A``, computed per layer without touching the model, so that it works the same on ZeRO-3
partitions and FSDP2 shards) under the base model's names: ``base_model.model.`` and ``.base_layer`` are stripped,
``lora_*`` tensors are skipped, and ``modules_to_save`` copies stand in for the frozen originals. So the engine
holds an ordinary model and never needs to know about adapters.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_PEFT_PREFIX = "base_model.model."
_MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.[^.]+\.")


def is_peft_model(model) -> bool:
    """True for a peft ``PeftModel`` (it has adapters that can be merged)."""
    return hasattr(model, "peft_config") and hasattr(model, "merge_adapter")


def plain_name(name: str) -> str | None:
    """The Hugging Face name of a peft parameter, or None for a tensor the engine does not hold."""
    if "lora_" in name or ".original_module." in name:
        return None
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    name = name.replace(".base_layer.", ".")
    return _MODULES_TO_SAVE.sub(".", name)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor: FSDP2 shards (DTensor) are gathered (a collective: every rank must call)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach()


def gathers_on_every_rank(model) -> bool:
    """True when whole weights need a collective on every rank: FSDP2 (DTensor) or DeepSpeed ZeRO-3 partitions."""
    return any(hasattr(p, "full_tensor") or hasattr(p, "ds_id") for p in model.parameters())


def sync_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The whole shape of a weight (a ZeRO-3 partition's own shape is empty)."""
    return tuple(getattr(t, "ds_shape", t.shape))


@contextlib.contextmanager
def whole_weights(params: list[torch.Tensor]):
    """ZeRO-3 partitions among ``params`` gathered whole for the block (one collective; every rank must enter it,
    in the same order); other tensors are left as they are (FSDP2 shards are gathered by ``_full``)."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed  # optional heavy package, only present with --deepspeed: not at the top

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


@contextlib.contextmanager
def whole_weight(param: torch.Tensor):
    """The whole weight (detached) inside the block: FSDP2 shards are gathered, a ZeRO-3 partition for the block
    only. A collective for sharded weights: every rank must enter it, in the same order."""
    if not hasattr(param, "ds_id"):
        yield _full(param)
        return
    import deepspeed  # optional heavy package, only present with --deepspeed: not at the top

    with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
        yield param.detach()


def named_sync_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(plain name, tensor) for every weight the engine needs, as stored now (no merging), in sync order."""
    peft = is_peft_model(model)
    for name, param in model.named_parameters():
        plain = plain_name(name) if peft else name
        if plain is not None:
            yield plain, param


def iter_sync_weights(model, stable: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, whole tensor) pairs to load into an engine, in ``named_sync_tensors``' order, LoRA merged.

    A collective for sharded models (FSDP2, ZeRO-3): every rank must run it to the end, in step. A LoRA layer's
    weight is ``W + delta`` computed from its base weight and adapters gathered together (one gather per layer; the
    model is never modified); every other weight is gathered alone. Without ``stable`` a tensor may be the model's
    own storage or a gather freed at the next step: read it before asking for the next. With ``stable`` each stays
    valid (a gathered ZeRO-3 partition is copied; merged and FSDP2-gathered tensors are new anyway).
    """
    peft = is_peft_model(model)
    layers = _lora_layers(model) if peft else {}
    done: set[int] = set()
    with torch.no_grad():
        for name, param in model.named_parameters():
            layer = layers.get(id(param))
            if layer is not None:
                if id(layer) not in done:
                    done.add(id(layer))
                    yield from _merged_layer(layer, stable)
                continue
            plain = plain_name(name) if peft else name
            if plain is None:
                continue
            with whole_weight(param) as whole:  # ZeRO-3: one parameter gathered at a time
                yield plain, _kept(whole, param, stable)


def _kept(t: torch.Tensor, param: torch.Tensor, stable: bool) -> torch.Tensor:
    """``t`` made to outlive its gather when asked: a ZeRO-3 gather is released when its block ends."""
    return t.clone() if stable and hasattr(param, "ds_id") else t


@dataclass
class _LoraLayer:
    module: torch.nn.Module  # peft's LoraLayer
    params: list[tuple[str, torch.Tensor]]  # (peft name, parameter) of the whole layer, in the model's order


def _lora_layers(model) -> dict[int, _LoraLayer]:
    """id(parameter) -> the peft LoRA layer it belongs to (base weights and adapters alike)."""
    from peft.tuners.lora import LoraLayer  # peft is present whenever a model has adapters: not at the top

    out: dict[int, _LoraLayer] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, LoraLayer):
            layer = _LoraLayer(module, [(f"{prefix}.{n}", p) for n, p in module.named_parameters()])
            out.update((id(p), layer) for _, p in layer.params)
    return out


def _merged_adapters(module) -> list[str]:
    """The adapters ``merge_adapter`` would merge into this layer: the active ones that it holds."""
    held = set(module.lora_A) | set(getattr(module, "lora_embedding_A", {}))
    return [a for a in module.active_adapters if a in held]


def _merged_layer(layer: _LoraLayer, stable: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain weights of one LoRA layer, its adapters merged into the base weight (the value peft's
    ``merge_adapter`` writes), with the layer's parameters gathered together for this block only. Plain LoRA is
    ``W + delta``, computed aside; DoRA and LoRA biases (more than a delta) go through peft's own merge of this one
    layer, read, then undone."""
    module = layer.module
    base = module.get_base_layer().weight
    adapters = _merged_adapters(module)
    by_peft = any(module.use_dora.get(a, False) or getattr(module, "lora_bias", {}).get(a, False) for a in adapters)
    with whole_weights([p for _, p in layer.params]):
        if by_peft:
            module.merge(adapter_names=adapters)
        try:
            for name, param in layer.params:
                plain = plain_name(name)
                if plain is None:
                    continue
                if by_peft:
                    yield plain, _full(param).clone()  # merged in place: copied before the merge is undone
                elif param is base:
                    merged = _full(param).clone()
                    for adapter in adapters:
                        merged += _full(module.get_delta_weight(adapter))  # as peft's merge: added in place
                    yield plain, merged
                else:
                    yield plain, _kept(_full(param), param, stable)
        finally:
            if by_peft:
                module.unmerge()
