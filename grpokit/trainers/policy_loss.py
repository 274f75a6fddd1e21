"""One micro-batch's policy loss from its logps: the loss mask, entropy logging and masking, the off-policy
sequence mask, rollout importance weights, then ``compute_policy_loss`` (grpokit.algorithms). What
``GRPOTrainer._compute_loss_and_metrics`` runs after the forward; a function of its inputs, so the trainer keeps
only the hook."""

from __future__ import annotations

import torch

from grpokit.algorithms import (
    LossConfig,
    LossInputs,
    behaviour_logps,
    compute_policy_loss,
    entropy_mask,
    entropy_threshold,
    mismatch_metrics,
    off_policy_sequence_mask,
    overlong_mask,
    rollout_importance_weights,
)
from grpokit.config.args import AlgorithmArguments
from grpokit.distributed.processes import gather_cat
from grpokit.trainers.batch import RolloutBatch


def needs_entropy(a: AlgorithmArguments) -> bool:
    return a.top_entropy_quantile < 1.0 or a.log_entropy


def policy_loss(
    logps: torch.Tensor,
    entropies: torch.Tensor | None,
    inputs: RolloutBatch,
    a: AlgorithmArguments,
    loss_cfg: LossConfig,
    accelerator,
) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of one micro-batch: ``logps`` [B, C] carry the gradient, ``entropies`` [B, C] or None;
    ``inputs`` on the training device (advantages, old/ref/rollout logps, masks, the loss denominator)."""
    # the loss mask (algorithms.loss_mask, as window_num_items counts): truncated rows out under --overlong_filter
    mask = overlong_mask(inputs.completion_mask, inputs.truncated) if a.overlong_filter else inputs.completion_mask
    metrics: dict = {}
    ent_mask = None
    if entropies is not None:
        if a.log_entropy:
            metrics["entropy"] = (entropies * mask).sum() / mask.sum().clamp(min=1)
        if a.top_entropy_quantile < 1.0:  # threshold over the global batch (ms-swift: mask keeps normaliser)
            ent_all = gather_cat(accelerator, entropies[mask.bool()])
            thr = entropy_threshold(ent_all, torch.ones_like(ent_all), a.top_entropy_quantile)
            ent_mask = entropy_mask(entropies, mask, thr)
    old = inputs.old_logps if inputs.old_logps is not None else logps.detach()
    if inputs.rollout_logps is not None:
        metrics.update(
            mismatch_metrics(_trainer_side(old, logps, inputs), inputs.rollout_logps, inputs.completion_mask)
        )
    seq_mask = None
    if a.off_policy_sequence_mask_delta is not None:  # behaviour policy: the engine's logprobs, else the old logps
        seq_mask, seq_metrics = off_policy_sequence_mask(
            logps, old, inputs.advantages, mask, a.off_policy_sequence_mask_delta, inputs.rollout_logps
        )
        metrics.update(seq_metrics)
    is_weights = None
    if a.rollout_importance_sampling_mode and inputs.rollout_logps is not None:
        rollout = behaviour_logps(old, inputs.rollout_logps)  # a token the engine did not sample: the old logp
        is_out = rollout_importance_weights(
            old, rollout, mask, a.rollout_importance_sampling_mode, a.rollout_importance_sampling_threshold
        )
        is_weights = is_out.weights
        metrics.update(is_out.metrics)
    out = compute_policy_loss(
        LossInputs(
            logps=logps,
            old_logps=old,
            advantages=inputs.advantages,
            mask=mask,
            ref_logps=inputs.ref_logps if loss_cfg.beta != 0 else None,
            rollout_is_weights=is_weights,
            num_items=inputs.num_items,
            entropy_mask=ent_mask,
            sequence_mask=seq_mask,
        ),
        loss_cfg,
    )
    metrics.update(out.metrics)
    return out.loss, metrics


def _trainer_side(old: torch.Tensor, logps: torch.Tensor, inputs: RolloutBatch) -> torch.Tensor:
    """The trainer's logps to hold against the engine's: the old logps, unless they are the engine's own
    (--async_generate and --use_rollout_logprobs copy them in), then this forward's (at most a window newer than
    the sampler's weights)."""
    engine = inputs.rollout_logps
    if inputs.old_logps is None or not torch.equal(old, torch.nan_to_num(engine.to(old.dtype), nan=0.0)):
        return old
    return logps.detach()
