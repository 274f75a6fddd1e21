"""CHORD: supervised (SFT) loss on expert replies mixed into the GRPO loss (arXiv 2508.11408).

    loss = (1 - mu) * grpo_loss + mu * sft_loss

``mu`` follows a schedule over optimizer steps: a linear warm-up from 0 to ``peak``, then a cosine decay from
``peak`` to ``valley``, then ``valley`` (CHORD-mu; peak == valley gives a constant mu). The SFT loss is the mean
negative log-likelihood of the expert tokens; CHORD-phi weights each token by ``phi = p * (1 - p)``, where ``p`` is
the model's probability of the expert token (a constant weight: no gradient flows through phi).

How this differs from the paper: as in ms-swift, the SFT term is computed once per GRPO micro-batch on a batch of
its own (``--chord_sft_per_device_train_batch_size`` rows), normalised by that batch's expert token count, and
both variants may be combined (a mu schedule and phi weighting at once).
"""

from __future__ import annotations

import math

import torch


def chord_mu(step: int, warmup_steps: int, decay_steps: int, peak: float, valley: float) -> float:
    """mu at optimizer step ``step`` (steps done so far): ``step / warmup_steps * peak`` during the warm-up, then
    ``valley + (peak - valley) * (1 + cos(pi * t / decay_steps)) / 2`` with ``t`` the steps since the warm-up,
    then ``valley`` from ``warmup_steps + decay_steps`` on."""
    if step < warmup_steps:
        return step / warmup_steps * peak
    if step >= warmup_steps + decay_steps:
        return valley
    t = step - warmup_steps
    return valley + (peak - valley) * 0.5 * (1.0 + math.cos(math.pi * t / decay_steps))


def chord_sft_loss(logps_BT: torch.Tensor, mask_BT: torch.Tensor, phi: bool = False) -> torch.Tensor:
    """Mean negative log-likelihood of the expert tokens (``mask_BT`` = 1), each weighted by ``p * (1 - p)``
    (detached) with ``phi``; 0 when the batch has no expert token."""
    nll = -logps_BT
    if phi:
        p = logps_BT.detach().exp()
        nll = nll * (p * (1.0 - p))
    mask = mask_BT.to(nll.dtype)
    return (nll * mask).sum() / mask.sum().clamp(min=1.0)


def chord_mix(grpo_loss: torch.Tensor, sft_loss: torch.Tensor, mu: float) -> torch.Tensor:
    """``(1 - mu) * grpo_loss + mu * sft_loss``."""
    return (1.0 - mu) * grpo_loss + mu * sft_loss
