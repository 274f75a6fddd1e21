"""A micro-batch larger than --per_device_train_batch_size trains in pieces whose weighted losses give the
whole micro-batch's gradient, for every built-in normaliser (trainers/row_pieces.py)."""

from __future__ import annotations

import pytest
import torch

from grpokit.algorithms import LossConfig, LossInputs, compute_policy_loss, loss_mask
from grpokit.trainers.batch import RolloutBatch
from grpokit.trainers.row_pieces import row_pieces

LENGTHS = [3, 1, 4, 2, 0, 4, 1, 3, 2, 4]  # 10 rows of up to 4 completion tokens; row 2 and 5 were truncated


def batch() -> RolloutBatch:
    n, c, p = len(LENGTHS), 4, 2
    cmask = torch.tensor([[1.0] * k + [0.0] * (c - k) for k in LENGTHS])
    attention = torch.cat([torch.ones(n, p, dtype=torch.long), torch.ones(n, c, dtype=torch.long)], 1)
    g = torch.Generator().manual_seed(0)
    return RolloutBatch(
        input_ids=torch.randint(0, 50, (n, p + c), generator=g),
        attention_mask=attention,
        position_ids=attention.cumsum(1) - 1,
        completion_mask=cmask,
        truncated=torch.tensor([k == 4 and i in (2, 5) for i, k in enumerate(LENGTHS)]),
        advantages=torch.randn(n, generator=g),
        old_logps=-torch.rand(n, c, generator=g),
        num_items=7.5,
    )


def loss_of(b: RolloutBatch, logps: torch.Tensor, cfg: LossConfig, overlong: bool) -> torch.Tensor:
    inputs = LossInputs(
        logps=logps,
        old_logps=b.old_logps,
        advantages=b.advantages,
        mask=loss_mask(b.completion_mask, b.truncated, overlong),
        num_items=b.num_items,
    )
    return compute_policy_loss(inputs, cfg).loss


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"])
@pytest.mark.parametrize("overlong", [False, True])
def test_pieces_of_the_configured_size_give_the_whole_micro_batchs_gradient(loss_type, overlong):
    b, cfg = batch(), LossConfig(loss_type=loss_type, max_completion_length=4)
    current = b.old_logps + 0.1 * torch.randn(b.old_logps.shape, generator=torch.Generator().manual_seed(1))
    whole = current.clone().requires_grad_(True)
    loss_of(b, whole, cfg, overlong).backward()

    parts = current.clone().requires_grad_(True)
    pieces = row_pieces(b, 4, loss_type, overlong)
    assert [len(p) for p, _ in pieces] == [4, 4, 2]
    start, total = 0, torch.zeros(())
    for piece, weight in pieces:
        piece.num_items = b.num_items  # as train_in_pieces passes the step's denominator on
        rows = parts[start : start + len(piece), : piece.logits_to_keep]
        loss = loss_of(piece, rows, cfg, overlong) * weight
        loss.backward()
        total, start = total + loss.detach(), start + len(piece)
    assert torch.allclose(total, loss_of(b, current, cfg, overlong), atol=1e-6)
    assert torch.allclose(parts.grad, whole.grad, atol=1e-6)


def test_a_micro_batch_that_fits_is_one_piece():
    b = batch()
    assert row_pieces(b, 10, "grpo", False) == [(b, 1.0)]
    assert row_pieces(b, 16, "bnpo", False) == [(b, 1.0)]
