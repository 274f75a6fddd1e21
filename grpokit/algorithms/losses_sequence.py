"""Two sequence-weighted loss types from TRL, registered into the registries of ``losses.py``.

- ``luspo`` — LUSPO (Length-Unbiased Sequence Policy Optimization, arXiv 2602.05261). GSPO's per-sequence loss
  averages over the group, so a long sequence weighs as much as a short one: per token, long sequences are
  under-weighted, which the paper shows drives the response length down. LUSPO multiplies each sequence's loss
  by its length |o_i|:

      L = (1/B) Σ_i |o_i| · ℓ_i,   ℓ_i = −min(s_i·A_i, clip(s_i, 1−ε, 1+ε_high)·A_i),  s_i = exp(mean_t log r_t)

  The per-token loss is GSPO's PPO clip (``ppo_clip_loss``, ``--delta`` allowed as in TRL); only the normaliser
  is new: Σ over the trained tokens of the broadcast per-token loss, / B — which is |o_i|·ℓ_i per sequence.
  TRL (``_compute_loss``, loss_type "luspo") computes ``(per_token_loss * mask.sum(1, keepdim=True)).mean()``;
  for the paper's setup (``--importance_sampling_level sequence``, β = 0, no entropy mask) the two agree exactly.
  They differ where TRL's per-token loss becomes [B, T]: there TRL multiplies every position by |o_i| and
  averages over all B×T positions, padding included, so β·KL, the entropy mask and token-level ratios get a
  length/T factor; grpokit sums each trained token once (β·KL_t counts like the policy term of its token).
  Differences from the paper: the mean runs over the micro-batch's B sequences rather than a group of G (as in
  TRL), and its clip range (section 5.1: ε = 2e-3, ε_high = 2.5e-3) is not imposed: set it, as for GSPO. Other IS
  levels run, with TRL's warning.

- ``vespo`` — VESPO (Variational sEquence-level Soft Policy Optimization, arXiv 2602.10693). A REINFORCE-style
  loss whose gradient is scaled by a smooth function of the *sequence* importance weight
  W = π_θ(o)/μ(o) = Π_t r_t (the product, no length normalisation):

      φ(W) = W^k · exp(λ·(1 − W))  (= exp(λ + k·log W − λ·W), φ(1) = 1),  ℓ_t = −sg[φ(W)]·A·log π_θ(y_t)

  with (k, λ) = (``vespo_k_pos``, ``vespo_lambda_pos``) for A ≥ 0 and (``vespo_k_neg``, ``vespo_lambda_neg``)
  for A < 0, defaults 2, 3, 3, 2 (TRL's, also those of the authors' veRL recipe; k and λ are the c1 and c2 of
  the paper's section 3.4). Normaliser: the global token count, like dapo (TRL; the recipe uses token-mean). As
  in TRL's ``get_gamma_weights``: log r_t is clamped to [−20, 20] per token and log W to [ln 1e-8, 20]; λ is
  floored at 1e-4; a non-finite φ becomes 0.
  μ is the policy that sampled: with a token-level ``--rollout_importance_sampling_mode`` the rollout weights
  w_t (truncated or masked π_old/π_rollout) join W in log space, log w_t clamped to [ln 1e-8, 20], and do not
  multiply the loss again (a masked token, w_t = 0, thus drives φ of its whole sequence towards 0). A
  sequence-level mode is refused, as TRL refuses it. The ratio of ``--importance_sampling_level`` is not used
  (only logged); TRL warns unless it is ``token``, and so does grpokit. Logged: ``vespo/phi_seq_mean``, the mean
  of φ over the micro-batch's sequences.
"""

from __future__ import annotations

import math

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
    global_token_normalized,
    ppo_clip_loss,
    warn_unless_level,
)
from grpokit.algorithms.rollout_is import TOKEN_LEVEL_MODES
from grpokit.errors import ConfigError

LOG_RATIO_BOUND = 20.0  # TRL's per-token and upper clamp of log W
LOG_W_FLOOR = math.log(1e-8)  # TRL's lower clamp of log W and of a rollout weight's log
LAMBDA_FLOOR = 1e-4


# ---------------------------------------------------------------------------------------------------------- luspo
def length_weighted_sum(per_token: Tensor, mask: Tensor, inp: LossInputs, cfg: LossConfig) -> Tensor:
    """LUSPO (arXiv 2602.05261) normaliser: [B, T] per-token loss (0 outside the mask) -> Σ_i Σ_t ℓ_it / B,
    i.e. mean_i |o_i|·(mean_t ℓ_it): GSPO's per-sequence loss weighted by the sequence length."""
    return per_token.sum() / per_token.shape[0]


def _check_luspo(cfg: LossConfig) -> None:
    warn_unless_level(
        cfg,
        ("sequence",),
        "LUSPO scales GSPO's sequence-level loss by the sequence length; use "
        "--importance_sampling_level sequence for the paper's setup",
    )


POLICY_LOSSES["luspo"] = ppo_clip_loss
LOSS_NORMALIZERS["luspo"] = length_weighted_sum
LOSS_CHECKS["luspo"] = _check_luspo


# ---------------------------------------------------------------------------------------------------------- vespo
@torch.no_grad()
def vespo_weights(terms: PolicyTerms, cfg: LossConfig) -> Tensor:
    """φ(W) per sequence [B, 1], detached."""
    mask = terms.mask  # [B, T]
    log_w = (terms.log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND) * mask).sum(-1, keepdim=True)  # [B, 1]
    if terms.rollout_is_weights is not None:  # W = π_θ/π_old · π_old/π_rollout, the ratio to the sampler
        log_is = torch.log(terms.rollout_is_weights).clamp(LOG_W_FLOOR, LOG_RATIO_BOUND)  # [B, T]; log 0 → floor
        log_w = log_w + (log_is * mask).sum(-1, keepdim=True)
    log_w = log_w.clamp(LOG_W_FLOOR, LOG_RATIO_BOUND)
    nonneg = terms.adv >= 0  # [B, 1]
    k = torch.full_like(log_w, cfg.vespo_k_neg).masked_fill(nonneg, cfg.vespo_k_pos)
    lam = torch.full_like(log_w, cfg.vespo_lambda_neg).masked_fill(nonneg, cfg.vespo_lambda_pos)
    lam = lam.clamp(min=LAMBDA_FLOOR)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # [B, 1]


def vespo_loss(terms: PolicyTerms, cfg: LossConfig) -> TokenLoss:
    """VESPO (arXiv 2602.10693): −sg[φ(W)]·A·log π_θ per token, so the gradient is φ(W)·A·∇log π; W includes the
    token-level rollout IS weights (TRL), which therefore do not multiply the loss again."""
    phi = vespo_weights(terms, cfg)  # [B, 1]
    return TokenLoss(loss=-phi * terms.adv * terms.logps, logged={"vespo/phi_seq_mean": phi}, includes_rollout_is=True)


def _check_vespo(cfg: LossConfig) -> None:
    for flag, value in (("--vespo_k_pos", cfg.vespo_k_pos), ("--vespo_k_neg", cfg.vespo_k_neg)):
        if not value >= 0:
            raise ConfigError(
                f"{flag} {value}: the power of VESPO's Gamma kernel W^k·e^(λ(1−W)) must be >= 0 "
                "(TRL's defaults: 2.0 for A >= 0, 3.0 for A < 0)"
            )
    for flag, value in (("--vespo_lambda_pos", cfg.vespo_lambda_pos), ("--vespo_lambda_neg", cfg.vespo_lambda_neg)):
        if not value > 0:
            raise ConfigError(
                f"{flag} {value}: the decay of VESPO's Gamma kernel must be > 0 (TRL's defaults: 3.0 "
                "for A >= 0, 2.0 for A < 0)"
            )
    mode = cfg.rollout_importance_sampling_mode
    if mode is not None and mode not in TOKEN_LEVEL_MODES:
        raise ConfigError(
            f"--loss_type vespo multiplies the rollout IS weights into its sequence weight token by "
            f"token, so --rollout_importance_sampling_mode {mode} does not fit; use "
            f"{' or '.join(TOKEN_LEVEL_MODES)} (TRL refuses the sequence modes too)"
        )
    warn_unless_level(
        cfg,
        ("token",),
        "VESPO builds its own sequence weight from the token log-ratios, so the "
        "level only changes the logged is_ratio/mean; leave it at token",
    )


POLICY_LOSSES["vespo"] = vespo_loss
LOSS_NORMALIZERS["vespo"] = global_token_normalized
LOSS_CHECKS["vespo"] = _check_vespo
