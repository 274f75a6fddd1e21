"""Trainer pieces that need no model: the prompt stream and the JSON-lines logs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from grpokit.trainers.outputs import JsonlLog
from grpokit.trainers.rollout_step import RolloutStepMixin


class Stream(RolloutStepMixin):
    def __init__(self, dataset, per_window: int, world: int, rank: int, shuffle: bool = True) -> None:
        self.train_dataset = dataset
        self.plan = SimpleNamespace(prompts_per_rollout=per_window)
        self.state = SimpleNamespace(prompts_consumed=0)
        self.accelerator = SimpleNamespace(num_processes=world, process_index=rank)
        self.cfg = SimpleNamespace(data=SimpleNamespace(dataset_shuffle=shuffle))
        self.args = SimpleNamespace(seed=3)
        self._orders = {}


def _expected(n: int, per_window: int, windows: int, world: int, rank: int) -> list[list[int]]:
    """Window by window, this rank's block of each window's positions in the seeded per-epoch permutations."""
    out = []
    for w in range(windows):
        share = per_window // world
        positions = range(w * per_window + rank * share, w * per_window + (rank + 1) * share)
        out.append([int(torch.randperm(n, generator=torch.Generator().manual_seed(3 + p // n))[p % n])
                    for p in positions])
    return out


@pytest.mark.parametrize("as_list", [False, True])
@pytest.mark.parametrize("world,rank", [(1, 0), (2, 0), (2, 1)])
def test_prompt_stream_follows_the_seeded_permutation_across_epochs(as_list, world, rank):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "solution": str(i)} for i in range(7)]
    stream = Stream(rows if as_list else Dataset.from_list(rows), per_window=4, world=world, rank=rank)
    got = [stream._next_prompts() for _ in range(4)]  # 16 positions: three epochs of 7
    for window, want in zip(got, _expected(7, 4, 4, world, rank), strict=True):
        assert [r["solution"] for r in window] == [str(i) for i in want]
        assert all(r["messages"] == rows[int(r["solution"])]["messages"] for r in window)
    assert [r["_prompt_index"] for r in got[1]] == list(range(4 + rank * 4 // world, 4 + (rank + 1) * 4 // world))
    assert stream.state.prompts_consumed == 16


def test_jsonl_log_appends_flushed_lines_and_truncates_on_resume(tmp_path):
    log = JsonlLog(tmp_path / "log.jsonl")
    for step in (1, 2, 3):
        log.write({"step": step, "text": "é"})
        assert len((tmp_path / "log.jsonl").read_text(encoding="utf-8").splitlines()) == step  # flushed at once
    log.truncate_after(2)
    log.write({"step": 3, "text": "again"})
    log.close()
    assert [json.loads(x) for x in (tmp_path / "log.jsonl").read_text(encoding="utf-8").splitlines()] == [
        {"step": 1, "text": "é"}, {"step": 2, "text": "é"}, {"step": 3, "text": "again"}]
    assert log.rows()[-1]["text"] == "again"
    off = JsonlLog(tmp_path / "off.jsonl", enabled=False)
    off.write({"step": 1})
    assert not (tmp_path / "off.jsonl").exists()
