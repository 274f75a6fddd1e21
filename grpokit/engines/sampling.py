"""Sampling pieces shared by the transformers engine's two decoders (grpokit's loop and HF ``generate``): the
logits processors HF builds for a request's settings, and one draw per row by inverse CDF."""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList
from transformers.generation import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from ``probs`` [B, V] given uniforms ``u`` [B, 1] in [0, 1): the first index whose
    cumulative probability exceeds u·total. Zero-probability entries add nothing to the running sum, so they are
    never the first to exceed it; u·total is kept strictly below the total against float rounding. The running
    sum is in float64: in float32, once it passes 0.5 a token of probability below ~3e-8 would add nothing and
    never be drawn."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]


def sampling_processors(*, greedy: bool, temperature: float, top_k: int, top_p: float, repetition_penalty: float,
                        extra: LogitsProcessorList | None = None) -> LogitsProcessorList:
    """The processors HF ``generate`` builds for these settings, in its order: repetition penalty, the caller's
    own processors (``extra``), then for sampling temperature, top-k and top-p."""
    procs = LogitsProcessorList()
    if repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    procs.extend(extra or [])
    if not greedy:
        if temperature != 1.0:
            procs.append(TemperatureLogitsWarper(temperature))
        if top_k > 0:
            procs.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p))
    return procs
