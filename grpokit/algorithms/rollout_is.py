"""Importance weights that correct the mismatch between the rollout engine and the training forward pass.

The engine (vLLM, or a server) samples from π_rollout, which differs from the trainer's π_old even with the same
weights (kernels, precision). Truncated/masked importance sampling (Yao et al., "Your Efficient RL Framework
Secretly Brings You Off-Policy RL Training", 2025, https://fengyao.notion.site/off-policy-rl, a blog post with
no arXiv id; ms-swift ``--rollout_importance_sampling_mode``) multiplies the per-token loss by a detached weight
built from ρ = π_old/π_rollout:

- ``token_truncate``: w_t = min(ρ_t, C)
- ``token_mask``: w_t = ρ_t if ρ_t ≤ C else 0
- ``sequence_truncate``: w_t = min(ρ_seq, C) for every token of the sequence
- ``sequence_mask``: w_t = ρ_t if ρ_seq ≤ C else 0 (whole sequences are dropped, kept ones keep token ratios)

ρ_seq is the *geometric mean* exp(mean_t log ρ_t), as in ms-swift, not the product exp(Σ_t log ρ_t) that TRL's
``vllm_importance_sampling_mode`` uses: the product of hundreds of token ratios is almost never below a threshold
of 2, the geometric mean is on the token ratios' scale. Log ratios are clamped to [−20, 20] before ``exp``
(ms-swift's safety bound), and weights are 0 on padding.

Metrics, logged as ``rollout_correction/<name>`` with ms-swift's names and formulas
(``GRPOTrainer._compute_rollout_offpolicy_metrics`` and ``_compute_is_correction_metrics``). Token means are over
the trained tokens; sequence means are over every row of the micro-batch, an empty row counting with ratio 1
(ms-swift's ``.mean()`` over the batch). With s_old, s_rollout the per-sequence mean log-probs:

- ``kl`` = mean_t(−log ρ_t), the k1 estimate of KL(π_rollout ‖ π_old) (the tokens were sampled from π_rollout);
  ``k3_kl`` = mean_t(ρ − log ρ − 1), the k3 estimate of the same KL, clamped like the loss's k3.
- ``training_ppl`` = mean_seq exp(−s_old), ``training_log_ppl`` = mean_seq(−s_old); ``rollout_ppl``,
  ``rollout_log_ppl`` the same with s_rollout; ``log_ppl_diff`` = mean_seq(s_rollout − s_old),
  ``log_ppl_abs_diff`` = mean_seq|s_rollout − s_old|, ``ppl_ratio`` = mean_seq exp(s_rollout − s_old).
- ``chi2_token`` = mean_t ρ_t² − 1; ``chi2_seq`` = mean_seq ρ_seq² − 1 with the geometric-mean ρ_seq.
- ``is_weight_mean`` = mean_t w_t; ``ess`` = 1 / mean_t((w'/mean w')²) with w' = clamp(w, 1/C, C) (1 when all
  weights are equal, and for a micro-batch without trained tokens); ``clipped_frac``: tokens with ρ_t > C for
  the token modes, sequences with ρ_seq > C for the sequence modes.

``mismatch_metrics`` reports the gap itself on every step with engine logprobs (``mismatch/max_abs``, ``mean_abs``,
``ratio_mean``); ``mismatch/max_abs`` is the one metric the loop reduces by its maximum, not its mean.

ms-swift's ``log_ppl_diff_max``/``_min`` are left out: grpokit averages every metric over micro-steps and ranks,
which would make them neither a maximum nor a minimum. TRL logs the same gap differently
(``sampling/sampling_logp_difference/*`` and ``sampling/importance_sampling_ratio/*``); grpokit follows
ms-swift, whose option names it uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpokit.algorithms.kl import k3_kl
from grpokit.errors import ConfigError
from grpokit.registry import Registry

SAFETY_BOUND = 20.0


@dataclass
class RolloutISOut:
    weights: Tensor  # [B, T] detached
    metrics: dict[str, Tensor]


@dataclass(frozen=True)
class _ModeOut:
    weights: Tensor  # [B, T]
    clipped_frac: Tensor  # scalar


ModeFn = Callable[[Tensor, Tensor, float], _ModeOut]  # (log_ratio [B,T], mask [B,T], threshold)
ROLLOUT_IS_MODES: Registry = Registry("rollout importance sampling mode", "--rollout_importance_sampling_mode")
TOKEN_LEVEL_MODES = ("token_truncate", "token_mask")  # a weight per token of ρ_t alone (vespo multiplies them up)


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _row_mean(x: Tensor, mask: Tensor) -> Tensor:
    """[B, T] -> [B]: mean over each row's trained tokens; 0 for an empty row."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


def _sequence_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """Geometric-mean ratio per sequence [B] (1 for an empty row)."""
    return torch.exp(_row_mean(log_ratio, mask))


def _sequence_clipped_frac(seq_ratio: Tensor, mask: Tensor, threshold: float) -> Tensor:
    return (seq_ratio > threshold).to(mask.dtype).mean()  # over every row, as ms-swift


@ROLLOUT_IS_MODES.register("token_truncate")
def token_truncate(log_ratio: Tensor, mask: Tensor, threshold: float) -> _ModeOut:
    ratio = torch.exp(log_ratio)
    return _ModeOut(torch.clamp(ratio, max=threshold), _masked_mean((ratio > threshold).to(mask.dtype), mask))


@ROLLOUT_IS_MODES.register("token_mask")
def token_mask(log_ratio: Tensor, mask: Tensor, threshold: float) -> _ModeOut:
    ratio = torch.exp(log_ratio)
    over = ratio > threshold
    return _ModeOut(torch.where(over, 0.0, ratio), _masked_mean(over.to(mask.dtype), mask))


@ROLLOUT_IS_MODES.register("sequence_truncate")
def sequence_truncate(log_ratio: Tensor, mask: Tensor, threshold: float) -> _ModeOut:
    seq = _sequence_ratio(log_ratio, mask)  # [B]
    weights = torch.clamp(seq, max=threshold).unsqueeze(-1).expand_as(log_ratio)
    return _ModeOut(weights, _sequence_clipped_frac(seq, mask, threshold))


@ROLLOUT_IS_MODES.register("sequence_mask")
def sequence_mask(log_ratio: Tensor, mask: Tensor, threshold: float) -> _ModeOut:
    seq = _sequence_ratio(log_ratio, mask)  # [B]
    keep = (seq <= threshold).to(log_ratio.dtype).unsqueeze(-1)  # [B, 1]
    return _ModeOut(torch.exp(log_ratio) * keep, _sequence_clipped_frac(seq, mask, threshold))


def validate_rollout_is_options(mode: str | None, threshold: float, use_rollout_logprobs: bool = False) -> None:
    """Unknown mode, a threshold below 1 (which would down-weight or drop on-policy tokens), or a mode beside
    --use_rollout_logprobs (the old logps are then the engine's, so every weight would be 1) → ConfigError."""
    if mode is None:
        return
    ROLLOUT_IS_MODES.get_or_raise(mode)
    if use_rollout_logprobs:
        raise ConfigError(
            f"--rollout_importance_sampling_mode {mode} weighs the trainer's old logps against the engine's; with "
            "--use_rollout_logprobs true the old logps are the engine's, so every weight would be 1. Drop one"
        )
    if not threshold >= 1.0:
        raise ConfigError(
            f"--rollout_importance_sampling_threshold {threshold}: must be >= 1 (an on-policy token "
            "has ratio 1); ms-swift's default is 2"
        )


@torch.no_grad()
def rollout_importance_weights(
    old_logps: Tensor, rollout_logps: Tensor, mask: Tensor, mode: str, threshold: float
) -> RolloutISOut:
    """Detached weights [B, T] from ρ = exp(old − rollout), and ``rollout_correction/*`` metrics."""
    validate_rollout_is_options(mode, threshold)
    apply_mode: ModeFn = ROLLOUT_IS_MODES.get_or_raise(mode)
    dtype = torch.promote_types(old_logps.dtype, torch.float32)
    maskf = (mask > 0).to(dtype)  # [B, T]
    old = torch.where(maskf > 0, old_logps.to(dtype), 0.0)  # padding may hold -inf
    rollout = torch.where(maskf > 0, rollout_logps.to(dtype), 0.0)
    log_ratio = (old - rollout).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [B, T] log ρ, 0 on padding
    out = apply_mode(log_ratio, maskf, threshold)
    weights = out.weights * maskf  # 0 on padding
    metrics = {
        **_offpolicy_metrics(old, rollout, maskf),
        **_weight_metrics(weights, maskf, threshold),
        "clipped_frac": out.clipped_frac,
    }
    return RolloutISOut(
        weights=weights.to(old_logps.dtype), metrics={f"rollout_correction/{k}": v for k, v in metrics.items()}
    )


def _offpolicy_metrics(old: Tensor, rollout: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The gap between π_old and π_rollout: [B, T] log-probs (0 on padding), [B, T] 0/1 mask -> scalars."""
    log_ratio = old - rollout  # [B, T] log ρ, unclamped as in ms-swift's kl
    s_old, s_rollout = _row_mean(old, mask), _row_mean(rollout, mask)  # [B]
    diff = s_rollout - s_old  # [B] log(training ppl / rollout ppl)
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))  # [B, T]
    rho_seq = torch.exp(_row_mean(log_ratio, mask).clamp(-SAFETY_BOUND, SAFETY_BOUND))  # [B]
    return {
        "kl": _masked_mean(-log_ratio, mask),
        "k3_kl": _masked_mean(k3_kl(rollout, old), mask),  # k3 with d = old − rollout = log ρ
        "training_ppl": torch.exp(-s_old).mean(),
        "training_log_ppl": (-s_old).mean(),
        "rollout_ppl": torch.exp(-s_rollout).mean(),
        "rollout_log_ppl": (-s_rollout).mean(),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": diff.abs().mean(),
        "ppl_ratio": torch.exp(diff).mean(),
        "chi2_token": _masked_mean(rho.square(), mask) - 1.0,
        "chi2_seq": rho_seq.square().mean() - 1.0,
    }


def _weight_metrics(weights: Tensor, mask: Tensor, threshold: float) -> dict[str, Tensor]:
    ess_w = weights.clamp(min=1.0 / threshold, max=threshold)
    ess_w = ess_w / (_masked_mean(ess_w, mask) + 1e-8)
    ess = torch.where(mask.sum() > 0, 1.0 / _masked_mean(ess_w.square(), mask).clamp(min=1e-10), 1.0)
    return {"is_weight_mean": _masked_mean(weights, mask), "ess": ess}


@torch.no_grad()
def mismatch_metrics(trainer_logps: Tensor, sampler_logps: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The per-token gap d = trainer − sampler logprob over the completion tokens ``mask`` [B, T] marks that have
    a sampler logprob (NaN ones are left out): ``mismatch/max_abs`` = max |d|, ``mismatch/mean_abs`` = mean |d|,
    ``mismatch/ratio_mean`` = mean exp(d) (d clamped to ±20). Empty dict when no token has a sampler logprob."""
    valid = (mask > 0) & ~torch.isnan(sampler_logps)
    if not bool(valid.any()):
        return {}
    d = trainer_logps.double()[valid] - sampler_logps.double()[valid]  # [n]
    return {
        "mismatch/max_abs": d.abs().max(),
        "mismatch/mean_abs": d.abs().mean(),
        "mismatch/ratio_mean": d.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().mean(),
    }
