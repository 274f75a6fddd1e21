"""The plain logps of a batch, as the trainer's ``_get_per_token_logps_and_entropies`` computes them when no
subclass overrides it (or ``_prepare_model_inputs``): the window producer calls this directly for old, reference
and teacher logps, without a detour through the trainer. Also the chunked, no-grad pass over a window's rows."""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpokit.trainers.batch import RolloutBatch
from grpokit.trainers.forward import model_kwargs
from grpokit.trainers.packing import ForwardOptions, completion_logps


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
