"""Policy losses of the GRPO family and their normalisation, as pure functions of per-token log-probs.

One call: ratio r = exp(log-weight) at the chosen importance-sampling level → per-token policy loss of the loss
type → × entropy mask → × off-policy sequence mask → × rollout IS weights → + β·k3 KL → zero outside the mask →
normaliser of the loss type. The masks and the rollout IS weights act on the policy term only; the β·KL term is
added after them, on every trained token, in TRL's order (``GRPOTrainer._compute_loss``).

Importance-sampling levels (``--importance_sampling_level``):
- ``token`` — GRPO (arXiv 2402.03300): r_t = π_θ/π_old per token.
- ``sequence`` — GSPO (arXiv 2507.18071): one r per sequence, exp(mean_t log r_t). The paper's tiny clip range
  (3e-4/4e-4) is not imposed; set ``--epsilon``/``--epsilon_high`` yourself.
- ``sequence_token`` — GSPO-token: value sg[r_seq]·π_θ/sg[π_θ] = r_seq, gradient per token.

Per-token losses (``--loss_type``; the registry maps each name to its family):
- ``grpo``/``bnpo``/``dr_grpo``/``dapo`` — PPO clip: −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A). The asymmetric
  range is DAPO's clip-higher (arXiv 2503.14476). With ``delta`` (two-sided clip, INTELLECT-2 arXiv 2505.07291,
  TRL semantics) the unclipped term uses min(r, δ), which bounds the loss of negative-advantage tokens whose
  ratio exploded.
- ``cispo`` — CISPO (MiniMax-M1, arXiv 2506.13585): −sg[min(r, ε_high)]·A·log π_θ. The paper clips the weight
  to [1−ε_low, 1+ε_high]; ms-swift and TRL (followed here) cap it from above only and read ``epsilon_high`` as the
  absolute cap. grpokit's default cap 5.0 (``loss_config``) is the value ms-swift's CISPO docs page and TRL's
  ``epsilon_high`` help give, after ScaleRL (arXiv 2510.13786); the code of both falls back to ``epsilon``.
- ``sapo`` — SAPO (arXiv 2511.20347): −σ(τ·(r−1))·(4/τ)·A with τ = τ_pos for A > 0 and τ_neg otherwise
  (defaults 1.0 and 1.05, the paper's). The 4/τ factor makes the gradient at r = 1 equal to the plain
  policy gradient. The paper gates token ratios; like TRL, a sequence-level ratio is accepted (one gate per
  sequence), with a warning.
- ``luspo``, ``vespo`` — in ``losses_sequence.py``, registered into the same registries.
- ``real`` — in ``losses_real.py`` (an in-group classification loss; no per-token policy term).

Normalisers (ms-swift's ``_compute_loss_and_metrics``, TRL's ``_compute_loss``):
- ``grpo``, ``sapo``: masked mean per sequence, then mean over the batch (the GRPO paper's 1/G Σ 1/|o_i| Σ_t).
- ``bnpo``: token mean over the micro-batch (TRL's name).
- ``dr_grpo``: sum / (B × max_completion_length). Dr. GRPO (arXiv 2503.20783) divides by a constant; ms-swift and
  TRL use the micro-batch size times the max completion length.
- ``dapo``, ``cispo``: sum / ``num_items`` — the trainer passes the global count of trained tokens of the
  optimizer step (``step_token_counts`` of the loss mask, so without the rows --overlong_filter drops, as TRL),
  already divided for gradient accumulation and ranks (``num_items_per_micro_batch``), so that every token
  weighs the same (DAPO's token-level loss).

Beyond the papers: values at masked positions never reach the loss or its gradient (a fully masked row gives 0,
not NaN, even if its log-probs are -inf), and the rollout IS weights multiply the policy term but not the KL term.
That is TRL's choice; ms-swift multiplies the KL term by them too (it applies the weights after adding β·KL).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from grpokit.algorithms.kl import k3_kl
from grpokit.errors import ConfigError
from grpokit.registry import Registry

logger = logging.getLogger(__name__)


@dataclass
class LossConfig:
    loss_type: str = "grpo"  # grpo | bnpo | dr_grpo | dapo | cispo | sapo | luspo | vespo | real
    importance_sampling_level: str = "token"  # token | sequence | sequence_token
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2  # clip-higher; for cispo the absolute cap on the IS weight (docs of both: 5.0)
    delta: float | None = None  # two-sided clip: cap on the unclipped ratio (TRL), must exceed 1 + epsilon_high
    beta: float = 0.0  # k3 KL coefficient in the loss
    tau_pos: float = 1.0  # sapo, A > 0
    tau_neg: float = 1.05  # sapo, A <= 0
    max_completion_length: int = 256  # dr_grpo normaliser
    vespo_k_pos: float = 2.0  # vespo Gamma kernel, A >= 0: power k (TRL's names and defaults)
    vespo_lambda_pos: float = 3.0  # vespo, A >= 0: decay λ
    vespo_k_neg: float = 3.0  # vespo, A < 0
    vespo_lambda_neg: float = 2.0  # vespo, A < 0
    rollout_importance_sampling_mode: str | None = None  # vespo folds token-level rollout IS weights into its W
    real_tau: float = 0.5  # real: temperature of the in-group classification (ms-swift's default)
    num_generations: int | None = None  # real: group size; a micro-batch holds whole groups of consecutive rows
    kl_bias_correction: bool = False  # KL × the (unclipped) importance ratio: unbiased off-policy (DeepSeek-V3.2)


@dataclass
class LossInputs:
    logps: Tensor  # [B, T] current policy (requires grad)
    old_logps: Tensor  # [B, T] policy at rollout time (detached)
    advantages: Tensor  # [B], or [B, T] per token (a teacher's term: algorithms/distill.py)
    mask: Tensor  # [B, T] 1 = trained token (completion mask, with overlong filter applied)
    ref_logps: Tensor | None = None  # [B, T] when beta != 0
    rollout_is_weights: Tensor | None = None  # [B, T] detached, multiplies the policy term (vespo: joins its W)
    num_items: float | None = None  # dapo/cispo/vespo denominator: global token count, scaled for accumulation/ranks
    entropy_mask: Tensor | None = None  # [B, T] 0/1: zeroes low-entropy tokens' policy loss, keeps the normaliser
    sequence_mask: Tensor | None = None  # [B] 0/1: zeroes whole sequences' policy loss, keeps the normaliser


@dataclass
class LossOut:
    loss: Tensor  # scalar
    metrics: dict[str, Tensor] = field(default_factory=dict)  # detached scalars


@dataclass(frozen=True)
class PolicyTerms:
    """What a per-token loss reads; ``logps`` and ``log_ratio`` hold 0 outside the mask."""

    ratio: Tensor  # [B, T] or [B, 1] importance weight at --importance_sampling_level
    logps: Tensor  # [B, T] log π_θ, carries the gradient
    log_ratio: Tensor  # [B, T] per-token log π_θ − log π_old, whatever the level
    adv: Tensor  # [B, 1] detached
    mask: Tensor  # [B, T] float 0/1
    rollout_is_weights: Tensor | None = None  # [B, T] detached, as passed in LossInputs (multiply by mask)


@dataclass(frozen=True)
class TokenLoss:
    loss: Tensor  # [B, T] or [B, 1] per-token policy loss before masking
    logged: dict[str, Tensor]  # metric name -> [B, T] or [B, 1] values (e.g. clip flags), logged as their mean
    includes_rollout_is: bool = False  # the loss folded PolicyTerms.rollout_is_weights in itself (vespo)


LogWeightFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (log_ratio, logps, mask) -> log importance weight
TokenLossFn = Callable[[PolicyTerms, LossConfig], TokenLoss]
NormalizerFn = Callable[[Tensor, Tensor, LossInputs, LossConfig], Tensor]  # (per_token, mask, inputs, cfg)
LossCheckFn = Callable[[LossConfig], None]  # raises ConfigError, or logs a warning

IS_LEVELS: Registry = Registry("importance sampling level", "--importance_sampling_level")
POLICY_LOSSES: Registry = Registry("loss type", "--loss_type")
LOSS_NORMALIZERS: Registry = Registry("loss type", "--loss_type")
LOSS_CHECKS: Registry = Registry("loss type", "--loss_type")  # optional, per loss type: run by validate_loss_config


def _sequence_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Masked mean over the last axis: [B, T] -> [B]; 0 for a fully masked row."""
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)


@IS_LEVELS.register("token")
def token_log_weights(log_ratio: Tensor, logps: Tensor, mask: Tensor) -> Tensor:
    return log_ratio  # [B, T]


@IS_LEVELS.register("sequence")
def sequence_log_weights(log_ratio: Tensor, logps: Tensor, mask: Tensor) -> Tensor:
    return _sequence_mean(log_ratio, mask).unsqueeze(-1)  # [B, 1]


@IS_LEVELS.register("sequence_token")
def sequence_token_log_weights(log_ratio: Tensor, logps: Tensor, mask: Tensor) -> Tensor:
    seq = _sequence_mean(log_ratio, mask).unsqueeze(-1).detach()  # [B, 1]
    return logps - logps.detach() + seq  # [B, T]: value = sequence log ratio, gradient = d logps


def ppo_clip_loss(terms: PolicyTerms, cfg: LossConfig) -> TokenLoss:
    """−min(r·A, clip(r, 1−ε_low, 1+ε_high)·A), with r capped at δ in the first term when ``delta`` is set."""
    ratio, adv = terms.ratio, terms.adv
    clipped = torch.clamp(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
    capped = ratio if cfg.delta is None else torch.clamp(ratio, max=cfg.delta)
    loss = -torch.min(capped * adv, clipped * adv)
    low = (ratio < 1.0 - cfg.epsilon_low) & (adv < 0)
    high = (ratio > 1.0 + cfg.epsilon_high) & (adv > 0)
    return TokenLoss(
        loss=loss,
        logged={"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low | high},
    )


def cispo_loss(terms: PolicyTerms, cfg: LossConfig) -> TokenLoss:
    """−sg[min(r, ε_high)]·A·log π: the capped weight is a constant, the gradient flows through log π only."""
    ratio, adv = terms.ratio, terms.adv
    weight = torch.clamp(ratio, max=cfg.epsilon_high).detach()
    capped = (ratio > cfg.epsilon_high) & (adv > 0)
    return TokenLoss(loss=-weight * adv * terms.logps, logged={"cispo_clip_ratio": capped})  # TRL's, ms-swift's name


def sapo_loss(terms: PolicyTerms, cfg: LossConfig) -> TokenLoss:
    """−σ(τ(r−1))·(4/τ)·A, τ = τ_pos for A > 0 else τ_neg; r of any level ([B, T] or [B, 1])."""
    adv = terms.adv
    tau = torch.full_like(adv, cfg.tau_neg).masked_fill(adv > 0, cfg.tau_pos)  # [B, 1]
    gate = torch.sigmoid(tau * (terms.ratio - 1.0)) * (4.0 / tau)
    return TokenLoss(loss=-gate * adv, logged={})


for _name in ("grpo", "bnpo", "dr_grpo", "dapo"):
    POLICY_LOSSES[_name] = ppo_clip_loss
POLICY_LOSSES["cispo"] = cispo_loss
POLICY_LOSSES["sapo"] = sapo_loss


def sequence_then_batch_mean(per_token: Tensor, mask: Tensor, inp: LossInputs, cfg: LossConfig) -> Tensor:
    return _sequence_mean(per_token, mask).mean()


def token_mean(per_token: Tensor, mask: Tensor, inp: LossInputs, cfg: LossConfig) -> Tensor:
    return per_token.sum() / mask.sum().clamp(min=1.0)


def max_length_normalized(per_token: Tensor, mask: Tensor, inp: LossInputs, cfg: LossConfig) -> Tensor:
    return per_token.sum() / (per_token.shape[0] * cfg.max_completion_length)


def global_token_normalized(per_token: Tensor, mask: Tensor, inp: LossInputs, cfg: LossConfig) -> Tensor:
    if inp.num_items is None:
        raise ConfigError(
            f"--loss_type {cfg.loss_type} divides by the global completion-token count; the trainer "
            "must pass LossInputs.num_items"
        )
    num_items = float(inp.num_items)
    if num_items < 0:
        raise ConfigError(f"LossInputs.num_items is {num_items}; it must be the (non-negative) global token count")
    return per_token.sum() / (num_items if num_items > 0 else 1.0)  # 0 tokens: the sum is 0 too


def uses_global_token_count(loss_type: str) -> bool:
    """The loss type divides by ``LossInputs.num_items``, so the trainer must count each step's tokens."""
    return LOSS_NORMALIZERS.get(loss_type) is global_token_normalized


def step_token_counts(mask: Tensor, micro_batches: int, gradient_accumulation_steps: int) -> Tensor:
    """[N, T] loss mask of one window, its micro-batches in row order -> [micro_batches / gas] trained tokens of
    each optimizer step on this process. Pass the mask the loss trains on (``loss_mask``): tokens of truncated
    rows under --overlong_filter are not trained, so they are not counted either."""
    per_micro = mask.sum(1).reshape(micro_batches, -1).sum(1)  # [S]
    return per_micro.reshape(-1, gradient_accumulation_steps).sum(1)  # [S / gas]


def num_items_per_micro_batch(step_counts: Tensor, gradient_accumulation_steps: int, world_size: int) -> list[float]:
    """[S / gas] global trained-token counts per optimizer step -> ``num_items`` of each of the S micro-batches.

    accelerate divides each micro-step's loss by gas and DDP averages gradients over the ranks, so each count is
    divided by gas × world: the step's gradient is then Σ token losses / count, every token weighing the same."""
    scale = gradient_accumulation_steps * world_size
    return (step_counts.repeat_interleave(gradient_accumulation_steps) / scale).tolist()


for _name, _fn in (
    ("grpo", sequence_then_batch_mean),
    ("sapo", sequence_then_batch_mean),
    ("bnpo", token_mean),
    ("dr_grpo", max_length_normalized),
    ("dapo", global_token_normalized),
    ("cispo", global_token_normalized),
):
    LOSS_NORMALIZERS[_name] = _fn


def compute_policy_loss(inp: LossInputs, cfg: LossConfig) -> LossOut:
    """The scalar loss and detached metrics ("is_ratio/mean", the loss type's clip ratios, "kl") of a micro-batch.
    Its names were checked at set-up, with the other options (``validate_loss_config``)."""
    token_loss: TokenLossFn = POLICY_LOSSES[cfg.loss_type]
    normalize: NormalizerFn = LOSS_NORMALIZERS[cfg.loss_type]
    log_weights: LogWeightFn = IS_LEVELS[cfg.importance_sampling_level]

    dtype = inp.logps.dtype
    mask = inp.mask.to(dtype)  # [B, T]
    keep = mask > 0
    logps = torch.where(keep, inp.logps, 0.0)  # padding may hold -inf or garbage: keep it out of values and grads
    old = torch.where(keep, inp.old_logps.detach().to(dtype), 0.0)
    log_ratio = logps - old  # [B, T]
    ratio = torch.exp(log_weights(log_ratio, logps, mask))  # [B, T] or [B, 1]
    adv = inp.advantages.detach().to(dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else torch.where(keep, adv, 0.0)  # [B, 1] or per token [B, T]
    rollout_w = None if inp.rollout_is_weights is None else inp.rollout_is_weights.detach().to(dtype)  # [B, T]

    out = token_loss(PolicyTerms(ratio, logps, log_ratio, adv, mask, rollout_w), cfg)
    per_token = out.loss  # [B, T] or [B, 1]: the policy term
    if inp.entropy_mask is not None:
        per_token = per_token * inp.entropy_mask.detach().to(dtype)
    if inp.sequence_mask is not None:  # [B] -> [B, 1]: fits a [B, T] and a sequence-level [B, 1] policy term
        per_token = per_token * inp.sequence_mask.detach().to(dtype).unsqueeze(-1)
    if rollout_w is not None and not out.includes_rollout_is:
        per_token = per_token * rollout_w
    kl = None
    if cfg.beta != 0.0:  # after the masks and weights: β·KL reaches every trained token unweighted
        if inp.ref_logps is None:
            raise ConfigError(
                f"--beta {cfg.beta} puts a KL term in the loss, which needs ref_logps; pass them or use --beta 0"
            )
        kl = k3_kl(logps, torch.where(keep, inp.ref_logps.detach().to(dtype), 0.0))  # [B, T]
        # the ratio carries gradient: at ratio 1 (on-policy) the KL's gradient changes too, as in TRL
        per_token = per_token + cfg.beta * (kl * ratio if cfg.kl_bias_correction else kl)
    per_token = torch.where(keep, per_token, 0.0)  # [B, T]
    loss = normalize(per_token, mask, inp, cfg)
    return LossOut(loss=loss, metrics=_metrics(ratio, out.logged, kl, keep))


@torch.no_grad()
def _metrics(ratio: Tensor, logged: dict[str, Tensor], kl: Tensor | None, keep: Tensor) -> dict[str, Tensor]:
    """Means over the micro-batch as TRL's ``global_masked_mean``: a [B, T] value is averaged over the trained
    tokens, a [B, 1] value (sequence-level ratio: one clip decision per sequence) over the B sequences."""
    count = keep.sum().clamp(min=1).to(ratio.dtype)

    def mean(x: Tensor) -> Tensor:
        x = x.to(ratio.dtype)
        if x.shape[-1] == 1 and keep.shape[-1] > 1:  # per sequence (with T = 1 a sequence is its one token)
            return x.mean()
        return torch.where(keep, x, 0.0).sum() / count

    metrics = {"is_ratio/mean": mean(ratio), **{name: mean(x) for name, x in logged.items()}}
    if kl is not None:
        metrics["kl"] = mean(kl)
    return {k: v.detach() for k, v in metrics.items()}


def validate_loss_config(cfg: LossConfig) -> None:
    """Raise ConfigError for unknown names, out-of-range values and combinations that would be ignored; log a
    warning (as TRL does) for an importance-sampling level the loss type's paper does not use."""
    POLICY_LOSSES.get_or_raise(cfg.loss_type)
    LOSS_NORMALIZERS.get_or_raise(cfg.loss_type)
    IS_LEVELS.get_or_raise(cfg.importance_sampling_level)
    for flag, value in (("--epsilon", cfg.epsilon_low), ("--epsilon_high", cfg.epsilon_high), ("--beta", cfg.beta)):
        if not value >= 0:  # also catches NaN
            raise ConfigError(f"{flag} {value}: must be >= 0")
    for flag, value in (("--tau_pos", cfg.tau_pos), ("--tau_neg", cfg.tau_neg)):
        if not value > 0:
            raise ConfigError(f"{flag} {value}: the SAPO gate temperature must be > 0 (paper: 1.0 and 1.05)")
    if cfg.max_completion_length < 1:
        raise ConfigError(f"--max_completion_length {cfg.max_completion_length}: must be >= 1")
    if cfg.delta is not None:
        if POLICY_LOSSES[cfg.loss_type] is not ppo_clip_loss:
            ppo = ", ".join(sorted(name for name, fn in POLICY_LOSSES.items() if fn is ppo_clip_loss))
            raise ConfigError(
                f"--delta applies to the PPO-clip loss types ({ppo}), not --loss_type {cfg.loss_type}; remove --delta"
            )
        if not cfg.delta > 1.0 + cfg.epsilon_high:
            raise ConfigError(
                f"--delta {cfg.delta}: must exceed 1 + epsilon_high = {1.0 + cfg.epsilon_high:g}, or it "
                "would override the clip range (TRL: delta > 1 + epsilon)"
            )
    check: LossCheckFn | None = LOSS_CHECKS.get(cfg.loss_type)
    if check is not None:
        check(cfg)


def warn_unless_level(cfg: LossConfig, levels: tuple[str, ...], why: str) -> None:
    """Log a warning when --importance_sampling_level is not one of ``levels`` (TRL warns, it does not refuse)."""
    if cfg.importance_sampling_level not in levels:
        logger.warning(
            "--loss_type %s with --importance_sampling_level %s: %s", cfg.loss_type, cfg.importance_sampling_level, why
        )


def _check_token_sum(cfg: LossConfig) -> None:
    warn_unless_level(
        cfg,
        ("token",),
        "this normaliser sums per-token terms, so a sequence-level ratio counts each "
        "sequence once per token (its length) instead of once, as GSPO does; for the GSPO paper's "
        "setup use --loss_type grpo",
    )


def _check_cispo(cfg: LossConfig) -> None:
    if cfg.epsilon_high < 1.0:
        raise ConfigError(
            f"--loss_type cispo reads --epsilon_high as the absolute cap on the IS weight; "
            f"{cfg.epsilon_high} < 1 would scale down every on-policy token; use e.g. --epsilon_high 5.0"
        )
    _check_token_sum(cfg)


def _check_sapo(cfg: LossConfig) -> None:
    warn_unless_level(
        cfg,
        ("token",),
        "the SAPO paper gates each token's ratio; here each sequence's ratio gets one gate, as TRL computes it",
    )


for _name in ("bnpo", "dr_grpo", "dapo"):
    LOSS_CHECKS[_name] = _check_token_sum
LOSS_CHECKS["cispo"] = _check_cispo
LOSS_CHECKS["sapo"] = _check_sapo
