"""Sampling pieces shared by the transformers engine's two decoders (grpokit's loop and HF ``generate``): the
logits processors HF builds for a request's settings, one draw per row by inverse CDF, and the check that the
logits sampled from are finite (weights gone NaN after a diverged step would otherwise surface as an unrelated
IndexError, or as garbage tokens under greedy decoding)."""

from __future__ import annotations

import math

import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpokit.errors import RolloutError


def check_finite_logits(row_values: torch.Tensor, step: int | None = None, rows: torch.Tensor | None = None) -> None:
    """RolloutError when a row's ``row_values`` [B] (the rows' largest logit, or their total probability) is
    NaN or infinite: the model's logits are not finite (at generated token ``step``, when given). ``rows``: the
    batch row of each value, when they are some rows of the batch (the decode loop's rows still running)."""
    bad = ~torch.isfinite(row_values)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        value = float(row_values[i])
        row = i if rows is None else int(rows[i])
        at = "" if step is None else f"at generated token {step} "
        raise RolloutError(
            f"sampling: the model's logits are not finite ({'nan' if math.isnan(value) else value}) "
            f"{at}of batch row {row}; the weights have diverged (see the loss and grad_norm of the "
            "last steps): lower --learning_rate or keep --max_grad_norm on"
        )


class FiniteLogitsCheck(LogitsProcessor):
    """For HF ``generate``: the same check on each step's scores (their row maxima: NaN and +inf propagate)."""

    def __init__(self, prompt_width: int) -> None:
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        check_finite_logits(
            scores.amax(-1).float().clamp(min=torch.finfo(torch.float32).min), input_ids.shape[1] - self.prompt_width
        )
        return scores


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row from ``probs`` [B, V] given uniforms ``u`` [B, 1] in [0, 1): the first index whose
    cumulative probability exceeds u·total. Zero-probability entries add nothing to the running sum, so they are
    never the first to exceed it; u·total is kept strictly below the total against float rounding. The running
    sum is in float64: in float32, once it passes 0.5 a token of probability below ~3e-8 would add nothing and
    never be drawn. ``rows``: the batch row of each row of ``probs``, for the error naming a row."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    check_finite_logits(total[:, 0], rows=rows)  # NaN/inf logits give NaN probabilities: no valid index to draw
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]


def sampling_processors(
    *,
    greedy: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    repetition_penalty: float,
    extra: LogitsProcessorList | None = None,
) -> LogitsProcessorList:
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
