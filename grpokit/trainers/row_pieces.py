"""One micro-step trained in pieces of at most ``--per_device_train_batch_size`` rows, whatever the window holds.

A window is planned at ``generation_batch_size`` rows, but an ``--agent`` rollout (or a multi-turn scheduler) may
bring more: each episode's calls start their own trajectories. The loop still cuts the window into
``steps_per_generation`` micro-batches, so each one can hold many more rows than the configured micro-batch. Here a
micro-step's batch is cut into consecutive pieces of the configured size; each piece runs its forward and
backward on its own (its activations freed before the next), and its loss is weighted so that the gradients add up
to the gradient of the whole micro-batch's loss, as its loss type normalises it:

- per-sequence means (grpo, sapo) and the max-length normaliser (dr_grpo): by the piece's share of the rows;
- the micro-batch token mean (bnpo): by the piece's share of the trained tokens;
- the global token count (dapo, cispo): weight 1 (the denominator is the optimizer step's, already fixed);
- a normaliser a plugin registered: by the share of the rows.

``--top_entropy_quantile``'s threshold is then taken over each piece's tokens. Under ``--deepspeed`` the engine
reduces gradients in its own ``backward`` at the accumulation boundary, so the micro-batch trains whole there.
"""

from __future__ import annotations

import contextlib

import torch

from grpokit.algorithms import LOSS_NORMALIZERS, loss_mask
from grpokit.algorithms.losses import global_token_normalized, token_mean
from grpokit.trainers.batch import RolloutBatch


def row_pieces(
    batch: RolloutBatch, rows: int, loss_type: str, overlong_filter: bool
) -> list[tuple[RolloutBatch, float]]:
    """``batch`` cut into consecutive pieces of at most ``rows`` rows, each trimmed, with the weight of its loss in
    the loss of the whole batch (see the module's docstring). A batch that fits is one piece of weight 1."""
    n = len(batch)
    if rows < 1 or n <= rows:
        return [(batch, 1.0)]
    bounds = [(i, min(n, i + rows)) for i in range(0, n, rows)]
    pieces = [batch.select(slice(a, b)).trim() for a, b in bounds]
    normalize = LOSS_NORMALIZERS.get(loss_type)
    if normalize is global_token_normalized:
        return [(p, 1.0) for p in pieces]
    if normalize is token_mean:
        tokens = loss_mask(batch.completion_mask, batch.truncated, overlong_filter).sum(1)
        total = float(tokens.sum())
        if total > 0:
            return [(p, float(tokens[a:b].sum()) / total) for p, (a, b) in zip(pieces, bounds, strict=True)]
    return [(p, (b - a) / n) for p, (a, b) in zip(pieces, bounds, strict=True)]


def train_in_pieces(trainer, model, inputs: RolloutBatch) -> tuple[torch.Tensor, dict]:
    """The loss of ``inputs`` (one micro-step, more rows than ``per_device_train_batch_size``, not under DeepSpeed:
    the loop decides) and its backward, in pieces of that many rows (the loss and metrics returned are the whole
    micro-batch's: the pieces' weighted sums)."""
    a = trainer.cfg.algorithm
    pieces = row_pieces(inputs, trainer.args.per_device_train_batch_size, a.loss_type, a.overlong_filter)
    total: torch.Tensor | None = None
    metrics: dict = {}
    for k, (piece, weight) in enumerate(pieces):
        piece.num_items = inputs.num_items
        last = k == len(pieces) - 1  # DDP reduces once, on the last piece of a synchronising micro-step
        quiet = contextlib.nullcontext() if last else trainer.accelerator.no_sync(model)
        with quiet:
            with trainer.accelerator.autocast():
                loss, piece_metrics = trainer._loss_call(model, piece)
            trainer.accelerator.backward(loss * weight)
        total = loss.detach() * weight if total is None else total + loss.detach() * weight
        share = len(piece) / len(inputs)  # metrics (means over the piece) averaged by rows
        for name, value in piece_metrics.items():
            value = value.detach() if isinstance(value, torch.Tensor) else value
            numeric = isinstance(value, (int, float, torch.Tensor))
            metrics[name] = metrics.get(name, 0.0) + value * share if numeric else value
    return total, metrics
