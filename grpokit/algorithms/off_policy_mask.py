"""Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556; ms-swift ``--off_policy_sequence_mask_delta``).

The paper's reasoning: a model learns most from its own mistakes, while a bad completion (negative advantage)
sampled by a policy the trained one has since moved far away from can mislead or destabilise the optimisation.
The mask drops such stale negatives from the policy loss, a whole sequence at a time:

    M_i = 0  if  A_i < 0  and  (1/|o_i|) Σ_t (log π_behaviour(o_t) − log π_θ(o_t)) > δ,   else 1

The mean runs over the sequence's trained tokens (the loss mask); it is a k1 estimate of KL(π_behaviour ‖ π_θ) on
that sequence, as its tokens are samples of π_behaviour. π_behaviour is the policy that sampled: the engine's
logprobs (``rollout_logps``) where the engine returned one, else the old logps (the trainer's forward at rollout
time), per token; a token the engine did not sample (a tool reply in a multi-turn trajectory: NaN in
``rollout_logps``) falls back to the old logp. Without old logps and engine logprobs π_behaviour is π_θ, the
divergence is 0 and nothing is masked: the trainer asks the engine for logprobs whenever the mask is on.

- A row without trained tokens is never masked (its divergence is 0; there is no division by zero).
- Positive-advantage rows are kept however far the policy moved, as are rows with A_i = 0.
- Advantages are per sequence [B] (grpokit's batch); per-token advantages [B, T] are read as the mean over the
  sequence's trained tokens, the same number when every token carries the sequence's advantage.
- The mask is computed without gradient: it selects sequences, it is not a term of the loss.

How the trainer applies it (``LossInputs.sequence_mask``, ``compute_policy_loss``): M_i multiplies the per-token
policy term of sequence i, inside the sum, as in the paper's objective, and the normaliser is left alone, so a
masked sequence still counts in the per-sequence mean of ``grpo`` and in the token counts of ``bnpo``/``dapo``.
ms-swift drops the masked tokens from its completion mask instead. That gives the same loss for ``grpo``,
``sapo``, ``dr_grpo``, ``dapo`` and ``cispo`` (a masked row's mean is 0 and the row still counts; the other
denominators do not read that mask), but ``bnpo``'s token mean then divides by fewer tokens, and the masked
sequences lose their β·KL term too. grpokit keeps β·KL on every trained token, as with its entropy mask and
rollout IS weights.

Metrics: ``off_policy_mask/masked_ratio`` is the fraction of the micro-batch's sequences masked (every row counts,
empty ones as kept); ``off_policy_mask/kl_mean`` the mean divergence over the rows with trained tokens (0 when
there are none).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpokit.errors import ConfigError


def behaviour_logps(old_logps: Tensor, rollout_logps: Tensor | None) -> Tensor:
    """[B, T]: the engine's logprob of each token where it has one (not NaN), else the old logp."""
    if rollout_logps is None:
        return old_logps
    rollout = rollout_logps.to(old_logps.dtype)
    return torch.where(torch.isnan(rollout), old_logps, rollout)


def _sequence_advantages(advantages: Tensor, keep: Tensor) -> Tensor:
    """[B] or [B, T] -> [B]: per-token advantages as their mean over the trained tokens."""
    if advantages.dim() == 1:
        return advantages
    if advantages.shape != keep.shape:
        raise ConfigError(
            f"off-policy sequence mask: advantages of shape {tuple(advantages.shape)} fit neither "
            f"[B] nor the mask's {tuple(keep.shape)}"
        )
    return torch.where(keep, advantages, 0.0).sum(-1) / keep.sum(-1).clamp(min=1).to(advantages.dtype)


@torch.no_grad()
def off_policy_sequence_mask(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    delta: float,
    rollout_logps: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(M [B] float 0/1, metrics) for ``logps``/``old_logps``/``rollout_logps`` [B, T] (current, old, engine with
    NaN where missing), ``advantages`` [B] or [B, T] and the loss ``mask`` [B, T]. 1 keeps the sequence."""
    if not delta >= 0:  # also NaN; the option's field refuses it first
        raise ConfigError(f"--off_policy_sequence_mask_delta {delta}: must be ≥ 0")
    keep = mask > 0
    behaviour = behaviour_logps(old_logps.float(), None if rollout_logps is None else rollout_logps.float())
    drift = torch.where(keep, behaviour - logps.detach().float(), 0.0)  # padding may hold -inf or garbage
    lengths = keep.sum(-1)  # [B]
    kl = drift.sum(-1) / lengths.clamp(min=1).to(drift.dtype)  # [B], 0 for an empty row
    adv = _sequence_advantages(advantages.detach().float(), keep)
    masked = (adv < 0) & (kl > delta) & (lengths > 0)
    has_tokens = lengths > 0
    metrics = {
        "off_policy_mask/masked_ratio": masked.float().mean() if masked.numel() else kl.new_zeros(()),
        "off_policy_mask/kl_mean": kl[has_tokens].mean() if has_tokens.any() else kl.new_zeros(()),
    }
    return (~masked).to(logps.dtype), metrics
