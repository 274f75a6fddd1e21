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

Metrics (masked over trained tokens): ``kl`` = mean log ρ, ``k3_kl`` = mean(ρ − log ρ − 1), ``weight_mean``,
``weight_max``, ``clipped_frac`` (tokens with ρ_t > C for token modes, sequences with ρ_seq > C for sequence
modes), and ``ess`` = 1 / mean((w'/mean w')²) with w' = clamp(w, 1/C, C) (ms-swift's effective sample size, 1 when
all weights are equal).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

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


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _sequence_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """Geometric-mean ratio per sequence [B]."""
    return torch.exp((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))


def _sequence_clipped_frac(seq_ratio: Tensor, mask: Tensor, threshold: float) -> Tensor:
    has_tokens = (mask.sum(-1) > 0).to(mask.dtype)  # [B]
    return ((seq_ratio > threshold).to(mask.dtype) * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


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


def validate_rollout_is_options(mode: str | None, threshold: float) -> None:
    """Unknown mode or a threshold below 1 (which would down-weight or drop on-policy tokens) → ConfigError."""
    if mode is None:
        return
    ROLLOUT_IS_MODES.get_or_raise(mode)
    if not threshold >= 1.0:
        raise ConfigError(f"--rollout_importance_sampling_threshold {threshold}: must be >= 1 (an on-policy token "
                          "has ratio 1); ms-swift's default is 2")


@torch.no_grad()
def rollout_importance_weights(old_logps: Tensor, rollout_logps: Tensor, mask: Tensor, mode: str,
                               threshold: float) -> RolloutISOut:
    """Detached weights [B, T] from ρ = exp(old − rollout), and ``rollout_is/*`` metrics."""
    validate_rollout_is_options(mode, threshold)
    apply_mode: ModeFn = ROLLOUT_IS_MODES.get_or_raise(mode)
    dtype = torch.promote_types(old_logps.dtype, torch.float32)
    maskf = (mask > 0).to(dtype)  # [B, T]
    log_ratio = torch.where(maskf > 0, old_logps.to(dtype) - rollout_logps.to(dtype), 0.0)
    log_ratio = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    out = apply_mode(log_ratio, maskf, threshold)
    weights = out.weights * maskf  # 0 on padding

    ess_w = weights.clamp(min=1.0 / threshold, max=threshold)
    ess_w = ess_w / (_masked_mean(ess_w, maskf) + 1e-8)
    has_tokens = maskf.sum() > 0
    ess = torch.where(has_tokens, 1.0 / _masked_mean(ess_w.square(), maskf).clamp(min=1e-10), 1.0)
    metrics = {
        "rollout_is/kl": _masked_mean(log_ratio, maskf),
        "rollout_is/k3_kl": _masked_mean(torch.exp(log_ratio) - log_ratio - 1.0, maskf),
        "rollout_is/weight_mean": _masked_mean(weights, maskf),
        "rollout_is/weight_max": torch.where(maskf > 0, weights, 0.0).max(),
        "rollout_is/clipped_frac": out.clipped_frac,
        "rollout_is/ess": ess,
    }
    return RolloutISOut(weights=weights.to(old_logps.dtype), metrics=metrics)
