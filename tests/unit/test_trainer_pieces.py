"""Trainer parts that need no model: the prompt stream, the window's helpers, the JSON-lines logs and the AdamW
builder."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from grpokit.protocol import RolloutInferRequest
from grpokit.runs.outputs import JsonlLog
from grpokit.trainers.optimizers import build_adamw
from grpokit.trainers.prompts import PromptStream
from grpokit.trainers.window import Window, completion_rows, window_metrics


def _stream(dataset, per_window: int, world: int, rank: int) -> PromptStream:
    return PromptStream(dataset, per_window, seed=3, shuffle=True, num_processes=world, process_index=rank)


def _expected(n: int, per_window: int, windows: int, world: int, rank: int) -> list[list[int]]:
    """Window by window, this rank's block of each window's positions in the seeded per-epoch permutations."""
    out = []
    for w in range(windows):
        share = per_window // world
        positions = range(w * per_window + rank * share, w * per_window + (rank + 1) * share)
        out.append(
            [int(torch.randperm(n, generator=torch.Generator().manual_seed(3 + p // n))[p % n]) for p in positions]
        )
    return out


@pytest.mark.parametrize("as_list", [False, True])
@pytest.mark.parametrize("world,rank", [(1, 0), (2, 0), (2, 1)])
def test_prompt_stream_follows_the_seeded_permutation_across_epochs(as_list, world, rank):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "solution": str(i)} for i in range(7)]
    stream = _stream(rows if as_list else Dataset.from_list(rows), per_window=4, world=world, rank=rank)
    got = [stream.next() for _ in range(4)]  # 16 positions: three epochs of 7
    for window, want in zip(got, _expected(7, 4, 4, world, rank), strict=True):
        assert [r["solution"] for r in window] == [str(i) for i in want]
        assert all(r["messages"] == rows[int(r["solution"])]["messages"] for r in window)
    assert [r["_prompt_index"] for r in got[1]] == list(range(4 + rank * 4 // world, 4 + (rank + 1) * 4 // world))
    assert stream.position == 16


def test_prompt_stream_reads_each_window_at_once_and_rewinds_on_resume():
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "solution": str(i)} for i in range(7)]
    reads = []

    class CountingDataset(Dataset):  # a real Dataset that records the index lists it is read with
        def __getitem__(self, key):
            if isinstance(key, list):
                reads.append(key)
            return super().__getitem__(key)

    base = Dataset.from_list(rows)
    stream = _stream(CountingDataset(base.data, base.info, base.split), per_window=2, world=1, rank=0)
    got = [stream.next() for _ in range(7)]  # 14 positions: two epochs
    assert [len(r) for r in reads] == [2] * 7  # one read per window
    want = _expected(7, 2, 7, 1, 0)
    assert [[r["solution"] for r in w] for w in got] == [[str(i) for i in w] for w in want]
    stream.position = 2  # a resume: positions map to rows, so a rewind reads them again
    assert [r["solution"] for r in stream.next()] == [str(i) for i in want[1]]
    assert stream.position == 4


def test_jsonl_log_appends_flushed_lines_and_truncates_on_resume(tmp_path):
    log = JsonlLog(tmp_path / "log.jsonl")
    for step in (1, 2, 3):
        log.write({"step": step, "text": "é"})
        assert len((tmp_path / "log.jsonl").read_text(encoding="utf-8").splitlines()) == step  # flushed at once
    log.truncate_after(2)
    log.write({"step": 3, "text": "again"})
    log.close()
    assert [json.loads(x) for x in (tmp_path / "log.jsonl").read_text(encoding="utf-8").splitlines()] == [
        {"step": 1, "text": "é"},
        {"step": 2, "text": "é"},
        {"step": 3, "text": "again"},
    ]
    assert log.rows()[-1]["text"] == "again"
    off = JsonlLog(tmp_path / "off.jsonl", enabled=False)
    off.write({"step": 1})
    assert not (tmp_path / "off.jsonl").exists()


ADAMW_ARGS = SimpleNamespace(learning_rate=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.99, adam_epsilon=1e-8)


def test_adamw_takes_the_fused_kernel_and_updates_as_the_per_tensor_loop_does():
    torch.manual_seed(0)
    start = [torch.randn(7, 3), torch.randn(5)]
    fused_params = [torch.nn.Parameter(t.clone()) for t in start]
    loop_params = [torch.nn.Parameter(t.clone()) for t in start]
    fused = build_adamw(fused_params, ADAMW_ARGS)
    loop = torch.optim.AdamW(loop_params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))
    assert fused.param_groups[0]["fused"] is True
    for _ in range(3):
        grads = [torch.randn_like(t) for t in start]
        for params, opt in ((fused_params, fused), (loop_params, loop)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            opt.step()
    for a, b, before in zip(fused_params, loop_params, start, strict=True):
        assert not torch.equal(a, before)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_adamw_falls_back_to_the_per_tensor_loop_when_the_fused_kernel_is_refused(monkeypatch):
    real = torch.optim.AdamW

    def no_fused(params, fused=None, **kwargs):
        if fused:
            raise RuntimeError("`fused=True` requires all the params to be floating point Tensors of supported devices")
        return real(params, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", no_fused)
    opt = build_adamw((p for p in [torch.nn.Parameter(torch.zeros(2))]), ADAMW_ARGS)  # a generator is fine too
    assert not opt.param_groups[0]["fused"] and len(opt.param_groups[0]["params"]) == 1


def _window(n: int = 4, num_items: list[float] | None = None) -> Window:
    from grpokit.trainers.batch import RolloutBatch

    # row i: a left-padded prompt of 1 + i % 2 tokens, then i + 1 completion tokens (of at most 4)
    att = torch.tensor([[0] * (1 - i % 2) + [1] * (1 + i % 2) + [1] * (i + 1) + [0] * (3 - i) for i in range(n)])
    batch = RolloutBatch(
        input_ids=att * 7,
        attention_mask=att,
        position_ids=(att.cumsum(-1) - 1).clamp(min=0),
        completion_mask=att[:, 2:].float(),
        truncated=torch.tensor([i == n - 1 for i in range(n)]),
        advantages=torch.arange(n, dtype=torch.float32),
    )
    batch.extra["row_id"] = torch.arange(n)
    return Window(batch, [], [], torch.zeros(n, 1), torch.zeros(n), {}, {}, num_items)


def test_window_micro_batches_are_consecutive_trimmed_slices_with_their_token_counts():
    micro = _window(num_items=[3.0, 7.0]).micro_batches(2)
    assert [m.extra["row_id"].tolist() for m in micro] == [[0, 1], [2, 3]]
    assert [m.advantages.tolist() for m in micro] == [[0.0, 1.0], [2.0, 3.0]]
    assert [m.completion_mask.shape[1] for m in micro] == [2, 4]  # each trimmed to its own longest completion
    assert [m.num_items for m in micro] == [3.0, 7.0]
    assert [m.num_items for m in _window().micro_batches(4)] == [None] * 4


def test_window_metrics_summarise_rewards_lengths_and_advantages():
    # rewards [0, 1, 2, 3]: mean 1.5, sample std sqrt(5/3) = 1.291; lengths 1..4; one of four truncated
    m = window_metrics(
        torch.tensor([0.0, 1.0, 2.0, 3.0]),
        torch.tensor([1, 2, 3, 4]),
        torch.tensor([0.0, 0.0, 0.0, 1.0]),
        {"reward/mean": 9.0, "frac_reward_zero_std": 0.5},
    )
    assert m == pytest.approx(
        {
            "reward": 1.5,
            "reward_std": (5 / 3) ** 0.5,
            "completions/mean_length": 2.5,
            "completions/max_length": 4.0,
            "completions/min_length": 1.0,
            "completions/clipped_ratio": 0.25,
            "frac_reward_zero_std": 0.5,
        }
    )
    assert window_metrics(torch.tensor([2.0]), torch.tensor([3]), torch.tensor([0.0]), {})["reward_std"] == 0.0


def test_completion_rows_keep_the_prompt_rewards_and_multi_turn_messages():
    from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RolloutOutput

    req = RolloutInferRequest(messages=[{"role": "user", "content": "2+2?"}], data_dict={}, prompt_id="0")
    turns = [
        [{"role": "assistant", "content": "4"}],
        [
            {"role": "assistant", "content": "5"},
            {"role": "user", "content": "no"},
            {"role": "assistant", "content": "4"},
        ],
    ]
    outputs = [
        RolloutOutput(
            response=ChatCompletionResponse(
                choices=[ChatCompletionResponseChoice(message=t[-1], finish_reason="stop", token_ids=[1])]
            ),
            messages=[*req.messages, *t],
            response_token_ids=[[1]],
            response_loss_mask=[[1]],
            request_id=req.request_id,
            prompt_id="0",
        )
        for t in turns
    ]
    rows = completion_rows(
        [req],
        outputs,
        torch.tensor([[1.0, float("nan")], [0.5, 0.0]]),
        torch.tensor([0.5, -0.5]),
        ["accuracy", "format"],
        step=3,
    )
    assert rows[0] == {
        "step": 3,
        "prompt": "2+2?",
        "completion": "4",
        "advantage": 0.5,
        "accuracy": 1.0,
        "format": None,
    }
    assert rows[1]["messages"][-3:] == turns[1] and rows[1]["advantage"] == -0.5
