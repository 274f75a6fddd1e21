"""The weights an inference engine needs from a training model, under their plain Hugging Face names.

A plain model yields its parameters as they are. A peft LoRA model yields the *merged* weights
(``W + scale * B @ A``) under the base model's names: ``base_model.model.`` and ``.base_layer`` are stripped,
``lora_*`` tensors are skipped, and ``modules_to_save`` copies stand in for the frozen originals. So the engine
holds an ordinary model and never needs to know about adapters.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

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
        name = name[len(_PEFT_PREFIX):]
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
    """(plain name, tensor) for every weight the engine needs, as stored now (no merging)."""
    peft = is_peft_model(model)
    for name, param in model.named_parameters():
        plain = plain_name(name) if peft else name
        if plain is not None:
            yield plain, param


def iter_sync_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs to load into an engine; LoRA adapters are merged while this generator is open.

    The tensors are the model's own storage (no copy): read each before asking for the next one. The adapter
    is unmerged when the generator finishes or is closed.
    """
    if not is_peft_model(model):
        for name, param in named_sync_tensors(model):
            with whole_weight(param) as whole:  # ZeRO-3: one parameter gathered at a time
                yield name, whole
        return
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise NotImplementedError("merging LoRA adapters into ZeRO-3 partitioned weights for a weight sync")
    with torch.no_grad():
        model.merge_adapter()
        try:
            for name, param in named_sync_tensors(model):
                yield name, _full(param)
        finally:
            model.unmerge_adapter()
