"""Batch collation by hand-worked rows, the prompt-ids memo, and where an engine's infer runs."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from grpokit.engines.base import InferEngine
from grpokit.rollout.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    RequestConfig,
    RolloutInferRequest,
)
from grpokit.rollout.scheduler import RolloutScheduler, run_trajectories
from grpokit.template.encode import EncodedSample
from grpokit.trainers.batch import collate

PAD = 0


def test_collate_pads_prompts_left_completions_right_and_counts_positions():
    samples = [EncodedSample([5, 6, 7], [8, 9], [1, 1]),
               EncodedSample([5], [8, 9, 10], [1, 0, 1])]
    b = collate(samples, PAD, truncated=[False, True])
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 5, 8, 9, 10]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert b.completion_mask.tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]
    assert b.completion_mask.dtype == torch.float32 and b.input_ids.dtype == torch.long
    assert b.truncated.tolist() == [False, True]
    assert b.rollout_logps is None


def test_collate_rollout_logprobs_are_nan_where_missing_and_cut_to_the_limit():
    samples = [EncodedSample([5], [8, 9, 10], [1, 1, 1], rollout_logprobs=[-0.5, -1.0, -1.5]),
               EncodedSample([5, 6], [8], [1])]  # this engine gave no logprobs
    b = collate(samples, PAD, truncated=[True, False], max_completion_length=2)
    assert b.input_ids.tolist() == [[0, 5, 8, 9], [5, 6, 8, 0]]
    lp = b.rollout_logps.tolist()
    assert lp[0] == [-0.5, -1.0]
    assert all(math.isnan(v) for v in lp[1])


def test_collate_empty_completion_keeps_one_column():
    b = collate([EncodedSample([5, 6], [], [])], PAD, truncated=[False])
    assert b.input_ids.tolist() == [[5, 6, 0]]
    assert b.completion_mask.tolist() == [[0.0]]


def test_encode_prompt_memo_hands_out_copies(tiny_template):
    msgs = [{"role": "user", "content": "what is 2 + 3"}]
    first = tiny_template.encode_prompt(msgs)
    first.append(-1)  # a caller editing its list must not change the next caller's
    assert tiny_template.encode_prompt(msgs) == first[:-1]
    assert tiny_template.encode_prompt([{"role": "user", "content": "what is 2 + 4"}]) != first[:-1]


@pytest.fixture
def tiny_template(tmp_path_factory):
    from grpokit.pipeline.models import load_tokenizer
    from grpokit.template.encode import ChatTemplate
    from grpokit.testing import build_tiny_model

    return ChatTemplate(load_tokenizer(str(build_tiny_model(tmp_path_factory.mktemp("tiny")))))


class WhereEngine(InferEngine):
    """Records the thread and torch thread count each infer runs with."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[threading.Thread, int]] = []

    def infer(self, requests, config):
        self.seen.append((threading.current_thread(), torch.get_num_threads()))
        choice = ChatCompletionResponseChoice(message={"role": "assistant", "content": "x"}, finish_reason="stop",
                                              token_ids=[1])
        return [ChatCompletionResponse(choices=[choice], prompt_token_ids=[1]) for _ in requests]


def _run_twice(engine: InferEngine) -> None:
    requests = [RolloutInferRequest(messages=[{"role": "user", "content": "hi"}]) for _ in range(3)]
    for _ in range(2):
        run_trajectories(RolloutScheduler(engine), requests, RequestConfig(max_tokens=4))


def test_infer_runs_on_one_long_lived_thread_with_the_callers_torch_thread_count():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = WhereEngine()
    try:
        _run_twice(engine)
    finally:
        torch.set_num_threads(before)
        engine.close()
    threads = {t for t, _ in engine.seen}
    assert len(engine.seen) == 2 and len(threads) == 1  # one batched call per rollout, on the same thread
    assert threads.pop() is not threading.current_thread()
    assert [n for _, n in engine.seen] == [1, 1]
    assert engine._worker is None  # close() stopped it


def test_infer_on_loop_thread_runs_on_the_callers_thread():
    engine = WhereEngine()
    engine.infer_on_loop_thread = True
    _run_twice(engine)
    assert [t for t, _ in engine.seen] == [threading.current_thread()] * 2
    assert engine._worker is None  # never started


def test_rollouts_reuse_one_event_loop_per_thread_and_leave_sigint_alone():
    import asyncio
    import signal

    loops: list[asyncio.AbstractEventLoop] = []

    class LoopEngine(WhereEngine):
        def infer(self, requests, config):
            loops.append(asyncio.get_event_loop())
            return super().infer(requests, config)

    engine = LoopEngine()
    engine.infer_on_loop_thread = True
    handler = signal.getsignal(signal.SIGINT)
    _run_twice(engine)
    other = threading.Thread(target=_run_twice, args=(engine,))
    other.start()
    other.join()
    assert signal.getsignal(signal.SIGINT) is handler
    assert loops[0] is loops[1] and loops[2] is loops[3] and loops[0] is not loops[2]
    assert len(engine.seen) == 4
