"""Batch collation by hand-worked rows, the prompt-ids memo, and where an engine's infer runs."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from grpokit.engines.base import InferEngine
from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RequestConfig, RolloutInferRequest
from grpokit.rollout.scheduler import RolloutScheduler, run_trajectories
from grpokit.template.encode import EncodedSample
from grpokit.trainers.batch import collate

# numerics: run again by .ci/run under the other dtype choice and torch's default thread count;
# the engine thread takes the caller's torch thread count
pytestmark = pytest.mark.numerics

PAD = 0


def test_collate_pads_prompts_left_completions_right_and_counts_positions():
    samples = [EncodedSample([5, 6, 7], [8, 9], [1, 1]), EncodedSample([5], [8, 9, 10], [1, 0, 1])]
    b = collate(samples, PAD, truncated=[False, True])
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 5, 8, 9, 10]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert b.completion_mask.tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]
    assert b.completion_mask.dtype == torch.float32 and b.input_ids.dtype == torch.long
    assert b.truncated.tolist() == [False, True]
    assert b.rollout_logps is None


def test_collate_rollout_logprobs_are_nan_where_missing_and_cut_to_the_limit():
    samples = [
        EncodedSample([5], [8, 9, 10], [1, 1, 1], rollout_logprobs=[-0.5, -1.0, -1.5]),
        EncodedSample([5, 6], [8], [1]),
    ]  # this engine gave no logprobs
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


def test_encode_prompts_batch_equals_one_by_one_and_keys_see_every_field(tiny_template):
    convs = [[{"role": "user", "content": f"what is {i} + 1"}] for i in range(3)]
    with_tool = [{"role": "user", "content": "what is 0 + 1", "name": "x"}]  # not a plain (role, content) pair
    batch = tiny_template.encode_prompts([convs[0], convs[1], convs[0], convs[2], with_tool])
    single = [tiny_template.tokenize(tiny_template.render_prompt(c)) for c in (*convs, with_tool)]
    assert batch == [single[0], single[1], single[0], single[2], single[3]]
    assert len(tiny_template._prompt_ids) == 4  # one entry per distinct conversation


@pytest.fixture
def tiny_template(tmp_path_factory):
    from grpokit.modeling import load_tokenizer
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
        choice = ChatCompletionResponseChoice(
            message={"role": "assistant", "content": "x"}, finish_reason="stop", token_ids=[1]
        )
        return [ChatCompletionResponse(choices=[choice], prompt_token_ids=[1]) for _ in requests]


class HookedScheduler(RolloutScheduler):
    """Single-turn with a hook: its trajectories run on the event loop, not the direct path."""

    async def on_turn_end(self, infer_request, response_choice, current_turn):
        return {"rollout_infos": {"hooked": True}}


def _run_twice(engine: InferEngine, scheduler_cls=HookedScheduler) -> None:
    requests = [RolloutInferRequest(messages=[{"role": "user", "content": "hi"}]) for _ in range(3)]
    for _ in range(2):
        run_trajectories(scheduler_cls(engine), requests, RequestConfig(max_tokens=4))


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


@pytest.mark.parametrize("scheduler_cls", [HookedScheduler, RolloutScheduler])
def test_infer_on_loop_thread_runs_on_the_callers_thread(scheduler_cls):
    engine = WhereEngine()
    engine.infer_on_loop_thread = True
    _run_twice(engine, scheduler_cls)
    assert [t for t, _ in engine.seen] == [threading.current_thread()] * 2
    assert engine._worker is None  # never started


def test_single_turn_batch_is_one_engine_call_with_tagged_trajectories():
    class TokenEngine(WhereEngine):
        def infer(self, requests, config):
            out = super().infer(requests, config)
            for k, (r, resp) in enumerate(zip(requests, out)):
                resp.choices[0].token_ids = [k, len(r.messages)]
                resp.choices[0].message["content"] = f"answer {k}"
            return out

    requests = [
        RolloutInferRequest(messages=[{"role": "user", "content": f"q{i}"}], request_id=f"r{i}", prompt_id=str(i // 2))
        for i in range(4)
    ]
    engine = TokenEngine()
    engine.infer_on_loop_thread = True
    outs = run_trajectories(RolloutScheduler(engine), requests, RequestConfig(max_tokens=4))
    assert len(engine.seen) == 1  # the trajectories' requests were gathered into one engine call
    assert [o.request_id for o in outs] == ["r0", "r1", "r2", "r3"]
    assert [o.prompt_id for o in outs] == ["0", "0", "1", "1"]
    assert outs[3].messages[-1] == {"role": "assistant", "content": "answer 3"}
    assert outs[3].response_token_ids == [[3, 1]] and outs[3].response_loss_mask == [[1, 1]]


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
