"""The training forward: its set-up decisions and inputs (which models compute each distinct prompt once, decided
once per run, not per call; the sampler's kept set the logps are taken over; the keyword arguments of
``model(**kwargs)`` for a batch), and the plain logps of a batch (``Logps``), as the trainer's
``_get_per_token_logps_and_entropies`` computes them when no subclass overrides it (or ``_prepare_model_inputs``):
the window producer calls it directly for old, reference and teacher logps, without a detour through the trainer.
Also the chunked, no-grad pass over a window's rows (``batched_logps``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpokit.algorithms import SamplerSupport
from grpokit.config.args import AlgorithmArguments, RolloutArguments
from grpokit.engines.prefix import worth_sharing
from grpokit.template.processor import collate_mm
from grpokit.trainers.batch import RolloutBatch
from grpokit.trainers.packing import ForwardOptions, completion_logps


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


class Logps:
    """``(model, inputs, compute_entropy=False)`` -> ([B, C] logps, [B, C] entropies or None), with the run's
    forward options: the temperature, --logps_chunk_size, --padding_free, and which models share prompts (decided
    once: trainers/forward.py's prompt_sharing) and the pixel dtype of image inputs."""

    def __init__(
        self, *, temperature: float, chunk_size: int, padding_free: bool, sharing: dict, pixel_dtype: torch.dtype
    ) -> None:
        self.temperature, self.chunk_size, self.padding_free = temperature, chunk_size, padding_free
        self.sharing, self.pixel_dtype = sharing, pixel_dtype

    def __call__(self, model, inputs: RolloutBatch, compute_entropy: bool = False, model_inputs: dict | None = None):
        opts = ForwardOptions(
            temperature=self.temperature,
            chunk_size=self.chunk_size,
            padding_free=self.padding_free,
            share_prompts=self.sharing.get(id(model), False),
        )
        kwargs = model_kwargs(inputs, self.pixel_dtype) if model_inputs is None else model_inputs
        # the sampler's kept set, or None (full)
        return completion_logps(model, kwargs, inputs.logits_to_keep, opts, compute_entropy, inputs.support)


@torch.no_grad()
def batched_logps(logps: Callable, model, batch: RolloutBatch, *, micro: int, accelerator, first: int = 0):
    """[B, C] logps of the window's rows from ``first`` on (NaN before it), ``micro`` rows at a time, no grad."""
    out = torch.zeros_like(batch.completion_mask)
    out[:first] = float("nan")
    for start in range(first, len(batch), micro):
        chunk = batch.select(slice(start, start + micro)).trim().to(accelerator.device)
        with accelerator.autocast():
            lp, _ = logps(model, chunk)
        out[start : start + micro, : lp.shape[1]] = lp.float().cpu()
    return out
