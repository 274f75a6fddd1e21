"""``real`` — REAL (Rewards as Labels, arXiv 2602.05630), registered into the registries of ``losses.py``.

REAL drops the advantage-weighted PPO term and trains a classifier inside each group instead. A completion's
logit is its mean token log-ratio to the rollout policy, s_k = (1/|o_k|) Σ_t log π_θ(o_t)/π_old(o_t); the rewards
are the labels: a completion with advantage > 0 is positive, any other negative. Per group,

    L_group = log(1 + Σ_{k ∈ O−} exp(s_k/τ)) + log(1 + Σ_{k ∈ O+} exp(−s_k/τ))

and the loss is Σ_groups L_group / (number of groups in the micro-batch). A group with no positive or no negative
completion has nothing to separate: it adds 0 but still counts in the denominator (as ms-swift). τ is
``--real_tau`` (ms-swift's default 0.5). The gradient weight of a completion is bounded by 1/τ and shrinks as the
group is classified correctly, which is the paper's fix for GRPO's unbounded weights on negative samples.

As in ms-swift (``loss_type == 'real'`` in its GRPO trainer):
- groups are read by position: the micro-batch holds whole groups of ``num_generations`` consecutive rows, so
  ``per_device_train_batch_size`` must be a multiple of ``num_generations`` (grpokit's config check says so);
- with ``--beta`` the k3 KL is added as a token mean over the micro-batch, β·Σ KL / Σ mask;
- rewards are not scaled (``--scale_rewards none`` is forced, with a warning when another mode was asked for):
  only the sign of the advantage matters here;
- without ``old_logps`` (one update per rollout) the logits are 0 in value and the gradient is that of the loss
  at s = 0, as the trainer passes the detached current log-probs as the old ones.
Options that would be silently void are refused instead: the entropy mask and rollout IS weights multiply a
per-token policy term, which REAL does not have. The importance-sampling level is not used (warning).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpokit.algorithms.losses import (
    LOSS_CHECKS,
    LOSS_NORMALIZERS,
    POLICY_LOSSES,
    LossConfig,
    LossInputs,
    PolicyTerms,
    TokenLoss,
    warn_unless_level,
)
from grpokit.errors import ConfigError

DEFAULT_REAL_TAU = 0.5  # ms-swift's --real_tau


def real_scores(logps: Tensor, old_logps: Tensor, mask: Tensor) -> Tensor:
    """[B, T] log-probs (0 or anything outside the mask) -> [B] mean token log-ratio s_k; 0 for an empty row."""
    keep = mask > 0
    log_ratio = torch.where(keep, logps - old_logps.detach(), 0.0)
    return log_ratio.sum(-1) / keep.sum(-1).clamp(min=1).to(logps.dtype)


def real_group_loss(scores_B: Tensor, advantages_B: Tensor, group_size: int, tau: float) -> Tensor:
    """REAL's classification loss of one micro-batch: Σ over groups of
    log(1 + Σ_neg e^{s/τ}) + log(1 + Σ_pos e^{−s/τ}), divided by the number of groups. ``scores_B`` and
    ``advantages_B`` hold whole groups of ``group_size`` consecutive rows; positive means advantage > 0."""
    b = scores_B.shape[0]
    if group_size < 1 or b % group_size:
        raise ConfigError(
            f"--loss_type real classifies whole groups, but this micro-batch has {b} rows for groups "
            f"of num_generations {group_size}; make per_device_train_batch_size a multiple of "
            "num_generations"
        )
    s_GK = (scores_B / tau).view(-1, group_size)  # [groups, K]
    pos_GK = (advantages_B.detach() > 0).view(-1, group_size)
    neg_GK = ~pos_GK
    valid_G = pos_GK.any(-1) & neg_GK.any(-1)  # [groups]
    zero_G1 = torch.zeros_like(s_GK[:, :1])
    neg_G = torch.logsumexp(torch.cat([s_GK.masked_fill(pos_GK, float("-inf")), zero_G1], dim=-1), dim=-1)
    pos_G = torch.logsumexp(torch.cat([(-s_GK).masked_fill(neg_GK, float("-inf")), zero_G1], dim=-1), dim=-1)
    per_group = torch.where(valid_G, neg_G + pos_G, 0.0)  # a one-label group: log(1 + Σ …) ≠ 0, so zeroed
    return per_group.sum() / s_GK.shape[0]


def real_token_loss(terms: PolicyTerms, cfg: LossConfig) -> TokenLoss:
    """REAL has no per-token policy term: 0 here, the whole loss is built by ``real_normalized``."""
    return TokenLoss(loss=torch.zeros_like(terms.logps), logged={})


def real_normalized(per_token: Tensor, mask: Tensor, inp: LossInputs, cfg: LossConfig) -> Tensor:
    """The REAL loss of the micro-batch plus its β·KL token mean (``per_token`` holds only β·KL: the policy term is
    0), as ms-swift adds it."""
    if cfg.num_generations is None:
        raise ConfigError("--loss_type real needs the group size: LossConfig.num_generations is not set")
    scores = real_scores(inp.logps, inp.old_logps, mask)  # [B]
    loss = real_group_loss(scores, inp.advantages.to(scores.dtype), cfg.num_generations, cfg.real_tau)
    if cfg.beta != 0.0:
        loss = loss + per_token.sum() / mask.sum().clamp(min=1.0)
    return loss


def _check_real(cfg: LossConfig) -> None:
    if not cfg.real_tau > 0:
        raise ConfigError(
            f"--real_tau {cfg.real_tau}: REAL's temperature must be > 0 (ms-swift's default {DEFAULT_REAL_TAU})"
        )
    if cfg.rollout_importance_sampling_mode is not None:
        raise ConfigError(
            f"--rollout_importance_sampling_mode {cfg.rollout_importance_sampling_mode} weights a "
            "per-token policy term, which --loss_type real does not have, so it would do nothing; "
            "remove it"
        )
    warn_unless_level(
        cfg,
        ("token",),
        "REAL's logit is always the mean token log-ratio of a completion, so the "
        "level only changes the logged is_ratio/mean",
    )


POLICY_LOSSES["real"] = real_token_loss
LOSS_NORMALIZERS["real"] = real_normalized
LOSS_CHECKS["real"] = _check_real
