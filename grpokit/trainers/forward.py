"""The training forward's set-up decisions and inputs: which models compute each distinct prompt once (decided
once per run, not per call), the sampler's kept set the logps are taken over, and the keyword arguments of
``model(**kwargs)`` for a batch."""

from __future__ import annotations

import torch

from grpokit.algorithms import SamplerSupport
from grpokit.config.args import AlgorithmArguments, RolloutArguments
from grpokit.engines.prefix import worth_sharing
from grpokit.template.processor import collate_mm
from grpokit.trainers.batch import RolloutBatch


def prompt_sharing(models: list, *, distributed: bool) -> dict[int, bool]:
    """id(model) → whether its forward computes each distinct prompt once (engines/prefix.py): only where the
    model is called directly, not under DDP/FSDP/DeepSpeed wrappers (their hooks expect one forward per backward)
    or gradient checkpointing, and only for models big enough for it to pay off. A model not in the map never
    shares."""
    out = {}
    for model in models:
        if model is None or distributed:
            continue
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        out[id(model)] = worth_sharing(model) and not getattr(base, "is_activation_checkpointing", False)
    return out


def model_kwargs(inputs: RolloutBatch, pixel_dtype: torch.dtype) -> dict:
    """``input_ids``, ``attention_mask``, ``position_ids``; a vision-language batch adds its rows' processor
    tensors (template/processor.py) and leaves positions to the model (Qwen-VL's are 3-D)."""
    if inputs.mm_inputs is None:
        return {
            "input_ids": inputs.input_ids,
            "attention_mask": inputs.attention_mask,
            "position_ids": inputs.position_ids,
        }
    c = inputs.logits_to_keep
    mm = collate_mm(inputs.mm_inputs, inputs.input_ids.shape[1] - c, c)
    mm = {k: v.to(inputs.input_ids.device) for k, v in mm.items()}
    if "pixel_values" in mm:
        mm["pixel_values"] = mm["pixel_values"].to(pixel_dtype)
    return {"input_ids": inputs.input_ids, "attention_mask": inputs.attention_mask, "position_ids": None, **mm}


def sampler_support(rollout: RolloutArguments, algorithm: AlgorithmArguments, template) -> dict | None:
    """The kept set every engine samples from, as the batch carries it (RolloutBatch.sampler_support): top-k,
    top-p, and for a vision-language template the special tokens the engines never emit (mm_generate's
    suppress_tokens, vLLM's allowed_token_ids). None where nothing is truncated or with --logps_support full."""
    if algorithm.logps_support == "full":
        return None
    blocked = list(template.blocked_token_ids) if getattr(template, "multimodal", False) else []
    support = SamplerSupport(top_k=max(rollout.top_k, 0), top_p=rollout.top_p, blocked=tuple(blocked))
    if not support.truncates:
        return None
    return {"top_k": support.top_k, "top_p": support.top_p, "min_p": support.min_p, "blocked": blocked}
