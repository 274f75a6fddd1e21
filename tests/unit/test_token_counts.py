"""The global token count of dapo/cispo/vespo: the loss mask after --overlong_filter, per optimizer step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpokit.algorithms import (
    LossConfig,
    LossInputs,
    compute_policy_loss,
    loss_mask,
    num_items_per_micro_batch,
    step_token_counts,
    uses_global_token_count,
)


def window():
    """8 rows = 4 micro-batches of 2 rows (S = 4), gas = 2. Row lengths [3, 1 | 2, 2 | 4, 0 | 1, 1]; rows 0 and
    4 (3 and 4 tokens) were truncated."""
    lengths = [3, 1, 2, 2, 4, 0, 1, 1]
    mask = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in lengths])  # [8, 4]
    truncated = torch.tensor([True, False, False, False, True, False, False, False])
    return mask, truncated


def test_loss_mask_drops_truncated_rows_only_with_the_filter():
    mask, truncated = window()
    assert torch.equal(loss_mask(mask, truncated, overlong_filter=False), mask)
    filtered = loss_mask(mask, truncated, overlong_filter=True)
    assert filtered.sum(1).tolist() == [0, 1, 2, 2, 0, 0, 1, 1]


def test_step_token_counts_exclude_truncated_tokens():
    mask, truncated = window()
    # no filter: micro-batches [3+1, 2+2, 4+0, 1+1] = [4, 4, 4, 2] → optimizer steps (gas 2) [8, 6]
    assert step_token_counts(mask, 4, 2).tolist() == [8, 6]
    # --overlong_filter: rows 0 and 4 leave → micro-batches [1, 4, 0, 2] → steps [5, 2]
    assert step_token_counts(loss_mask(mask, truncated, True), 4, 2).tolist() == [5, 2]


def test_num_items_per_micro_batch():
    # global counts per step [10, 4] (2 ranks), gas 2: each of a step's micro-batches gets count / (gas · world)
    assert num_items_per_micro_batch(torch.tensor([10.0, 4.0]), 2, 2) == [2.5, 2.5, 1.0, 1.0]


def test_uses_global_token_count():
    names = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
    assert {lt for lt in names if uses_global_token_count(lt)} == {"dapo", "cispo", "vespo"}
    assert not uses_global_token_count("no_such_loss")


def test_dapo_step_loss_is_token_mean_of_trained_tokens():
    # on-policy, A = +1 for every row: each trained token's loss is -1. With --overlong_filter the step's 5 trained
    # tokens (rows 1, 2, 3 of micro-batches 0-1) give loss −5/5 = −1 summed over the step's micro-batches (each
    # divided by gas = 2, as accelerate does). Counting the truncated row's 3 tokens would give −5/8.
    mask, truncated = window()
    trained = loss_mask(mask, truncated, True)
    num_items = num_items_per_micro_batch(step_token_counts(trained, 4, 2), 2, 1)
    total = 0.0
    for i in range(2):  # the first optimizer step: micro-batches 0 and 1
        rows = slice(2 * i, 2 * i + 2)
        logps = torch.full((2, 4), -0.7, dtype=torch.float64)
        inp = LossInputs(
            logps=logps,
            old_logps=logps.clone(),
            advantages=torch.ones(2, dtype=torch.float64),
            mask=trained[rows].double(),
            num_items=num_items[i],
        )
        total += compute_policy_loss(inp, LossConfig(loss_type="dapo")).loss.item() / 2
    assert total == pytest.approx(-1.0)


@pytest.mark.parametrize("overlong_filter, expected", [(False, [4.0, 4.0, 3.0, 3.0]), (True, [2.5, 2.5, 1.0, 1.0])])
def test_trainer_counts_the_filtered_mask(overlong_filter, expected):
    # window_num_items on a one-process window: steps [8, 6] or, filtered, [5, 2], divided by gas 2
    from grpokit.trainers.window import window_num_items

    mask, truncated = window()
    one_process = SimpleNamespace(num_processes=1)  # gather_rows returns a single process's rows as they are
    got = window_num_items(
        mask,
        truncated,
        loss_type="dapo",
        overlong_filter=overlong_filter,
        steps_per_generation=4,
        gradient_accumulation_steps=2,
        accelerator=one_process,
    )
    assert got == expected
    assert (
        window_num_items(
            mask,
            truncated,
            loss_type="grpo",
            overlong_filter=overlong_filter,
            steps_per_generation=4,
            gradient_accumulation_steps=2,
            accelerator=one_process,
        )
        is None
    )
