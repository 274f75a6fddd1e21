"""collate_mm (template/processor.py): rows' processor tensors → one batch's model inputs, the same function for
the engine and the trainer; RolloutBatch keeps each row's tensors with the row when it is split."""

from __future__ import annotations

import torch

from grpokit.template.encode import EncodedSample
from grpokit.template.processor import MMRow, collate_mm
from grpokit.trainers.batch import collate


def _qwen_row(n_images: int, prompt_len: int) -> MMRow:
    """Qwen-VL layout: image i owns grid_thw[i].prod() rows of pixel_values; token types over the prompt."""
    if not n_images:
        return MMRow({"mm_token_type_ids": torch.zeros(1, prompt_len, dtype=torch.long)})
    grids = torch.tensor([[1, 2, 2 + k] for k in range(n_images)])
    rows = int(grids.prod(-1).sum())
    return MMRow(
        {
            "pixel_values": torch.arange(rows * 3, dtype=torch.float).view(rows, 3) + 100 * n_images,
            "image_grid_thw": grids,
            "mm_token_type_ids": torch.ones(1, prompt_len, dtype=torch.long),
        }
    )


def test_qwen_rows_concatenate_patches_and_pad_token_types():
    rows = [_qwen_row(2, 4), _qwen_row(0, 3), _qwen_row(1, 5)]
    out = collate_mm(rows, prompt_width=5, completion_width=2)
    # patches: 1*2*2 + 1*2*3 = 10 rows for the first, 4 for the third
    assert out["pixel_values"].shape == (14, 3)
    assert out["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 3], [1, 2, 2]]
    assert out["mm_token_type_ids"].tolist() == [[0, 1, 1, 1, 1, 0, 0], [0] * 7, [1, 1, 1, 1, 1, 0, 0]]


def test_a_batch_without_images_gives_only_token_types():
    out = collate_mm([_qwen_row(0, 2), _qwen_row(0, 3)], prompt_width=3)
    assert set(out) == {"mm_token_type_ids"} and out["mm_token_type_ids"].shape == (2, 3)


def test_idefics_rows_are_padded_to_the_most_images_with_zero_images():
    def row(n):
        if not n:
            return MMRow()
        return MMRow({"pixel_values": torch.ones(1, n, 3, 4, 4), "pixel_attention_mask": torch.ones(1, n, 4, 4)})

    out = collate_mm([row(1), row(0), row(2)], prompt_width=3)
    assert out["pixel_values"].shape == (3, 2, 3, 4, 4)
    assert out["pixel_values"].sum((2, 3, 4)).tolist() == [[48, 0], [0, 0], [48, 48]]
    assert out["pixel_attention_mask"].sum((2, 3)).tolist() == [[16, 0], [0, 0], [16, 16]]


def test_split_keeps_each_rows_images_with_it():
    rows = [_qwen_row(n, 3) for n in (0, 1, 2, 0, 2, 1)]
    samples = [EncodedSample([7, 8, 9], [5, 6], [1, 1], extra={"mm": r}) for r in rows]
    batch = collate(samples, pad_id=0, truncated=[False] * 6)
    halves = batch.split(2)
    assert [len(h.mm_inputs) for h in halves] == [3, 3]
    assert [r is rows[i] for i, r in enumerate(halves[0].mm_inputs + halves[1].mm_inputs)] == [True] * 6
    whole = collate_mm(batch.mm_inputs, 3, 2)["pixel_values"]
    parts = [collate_mm(h.mm_inputs, 3, 2)["pixel_values"] for h in halves]
    assert torch.equal(whole, torch.cat(parts))  # the two micro-batches hold exactly the whole batch's patches
    picked = batch.select(torch.tensor([5, 1]))
    assert picked.mm_inputs == [rows[5], rows[1]]
    assert batch.select(torch.tensor([True, False, True, False, False, False])).mm_inputs == [rows[0], rows[2]]


def test_join_rows_puts_a_later_turns_images_after_the_prompts_and_split_cuts_token_types():
    """A trajectory's row: the prompt's image, 2 completion tokens, then an observation with one image."""
    from grpokit.template.processor import join_rows

    prompt, observation = _qwen_row(1, 3), _qwen_row(1, 2)
    row = join_rows(join_rows(prompt, 3, MMRow(), 2), 5, observation, 2)
    assert row.tensors["mm_token_type_ids"].tolist() == [[1, 1, 1, 0, 0, 1, 1]]
    assert row.tensors["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2]]
    assert torch.equal(
        row.tensors["pixel_values"], torch.cat([prompt.tensors["pixel_values"], observation.tensors["pixel_values"]])
    )
    cut = row.split(3)
    assert cut.tensors["mm_token_type_ids"].tolist() == [[1, 1, 1]]
    assert cut.completion["mm_token_type_ids"].tolist() == [[0, 0, 1, 1]]
    # the batch: the prompt's token types left-padded, the completion's after them, zeros to the width
    out = collate_mm([cut, _qwen_row(0, 2)], prompt_width=4, completion_width=5)
    assert out["mm_token_type_ids"].tolist() == [[0, 1, 1, 1, 0, 0, 1, 1, 0], [0] * 9]
    # Idefics3's per-row image axis: a text-only prompt joined with an observation image
    idefics = MMRow({"pixel_values": torch.ones(1, 1, 3, 4, 4), "pixel_attention_mask": torch.ones(1, 1, 4, 4)})
    both = join_rows(idefics, 4, idefics, 3)
    assert both.tensors["pixel_values"].shape == (1, 2, 3, 4, 4)
    assert join_rows(MMRow(), 4, idefics, 3).tensors["pixel_values"].shape == (1, 1, 3, 4, 4)


def test_cutting_a_trajectory_through_an_observation_image_is_refused():
    import pytest

    from grpokit.errors import RolloutError

    sample = EncodedSample([1, 2], [3, 4, 5, 6], [1, 0, 0, 1], extra={"mm": MMRow(), "images_end": 3})
    with pytest.raises(RolloutError, match="observation image tokens beyond --max_completion_length 2"):
        collate([sample], pad_id=0, truncated=[True], max_completion_length=2)
    fine = EncodedSample([1, 2], [3, 4, 5, 6], [1, 0, 0, 1], extra={"mm": MMRow(), "images_end": 3})
    assert collate([fine], pad_id=0, truncated=[True], max_completion_length=3).completion_mask.shape == (1, 3)
