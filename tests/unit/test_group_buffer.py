"""GroupBuffer (--stream_groups) against fake producers whose calls the test times: a group that is done trains
while another is still generating; no trained group is older than K under ``wait`` and ``drop``; every prompt
drawn is trained once, dropped and drawn again, or pending; several producers each feed the windows; dynamic
sampling skips groups without signal; errors and drains; a checkpoint's windows replay prompt by prompt."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from grpokit.config.async_rules import check_stream_groups
from grpokit.config.plan import BatchPlan
from grpokit.errors import ConfigError
from grpokit.protocol import ChatCompletionResponse, RolloutInferRequest, RolloutOutput
from grpokit.trainers.group_buffer import GroupBuffer, loop_position
from grpokit.trainers.prompts import PromptStream
from grpokit.trainers.window import WindowRollout
from grpokit.trainers.window_producer import WindowProducer

G = 2  # completions per group


class FakeProducer:
    """What GroupBuffer uses of a WindowProducer: a one-prompt-per-draw stream, ``weights_at``, ``requests``,
    ``tag``, ``rewards_of`` (reward = the prompt's ordinal parity when ``flat`` names no signal, else 0/1)."""

    def __init__(self, n_prompts: int = 1000, flat=lambda pos: False) -> None:
        self.prompts = PromptStream([{"q": i} for i in range(n_prompts)], 1, seed=0, shuffle=False)
        self.weights_at, self.flat = 0, flat
        self.rewards = SimpleNamespace(weights=torch.ones(1))
        self.tag = WindowProducer.tag

    def requests(self, prompts):
        return [
            RolloutInferRequest(messages=[{"role": "user", "content": str(p["q"])}], prompt_id=str(p["_prompt_index"]))
            for p in prompts
            for _ in range(G)
        ]

    def rewards_of(self, requests, outputs):
        flat = self.flat(int(requests[0].prompt_id))
        return torch.tensor([[0.0 if flat else float(i % 2)] for i in range(len(outputs))])


def call(delay=lambda pos: 0.0, gate: dict | None = None, fail_at: int | None = None, log: list | None = None):
    """An async producer call: waits ``delay(ordinal)`` seconds (and for ``gate[ordinal]``, a threading.Event)."""

    async def run(requests):
        pos = int(requests[0].prompt_id)
        if fail_at is not None and pos >= fail_at:
            raise RuntimeError("the rollout server went away")
        await asyncio.sleep(delay(pos))
        while gate is not None and pos in gate and not gate[pos].is_set():
            await asyncio.sleep(0.005)
        if log is not None:
            log.append(pos)
        return [
            RolloutOutput(
                response=ChatCompletionResponse(choices=[]), messages=[], request_id=r.request_id, prompt_id=r.prompt_id
            )
            for r in requests
        ]

    return run


def _rollout_call(producer, call):
    """The producer's one rollout call (rollout_groups) around a fake engine ``call``: requests, tag, score."""

    async def run(prompts, version, *, beside=None):
        requests = producer.requests(prompts)
        t0 = time.perf_counter()
        outputs = producer.tag(await call(requests), version)
        rewards = producer.rewards_of(requests, outputs)
        return WindowRollout(requests, outputs, rewards, {"rollout": time.perf_counter() - t0, "reward": 0.0})

    return run


def _buffer(producer, calls, k, policy="wait", spw=1, per_window=2, **kw) -> GroupBuffer:
    calls = [_rollout_call(producer, c) for c in calls]
    return GroupBuffer(
        producer, calls, max_staleness=k, steps_per_window=spw, groups_per_window=per_window, policy=policy, **kw
    )


def _train(buffer, producer, windows: int, spw: int = 1, train_s: float = 0.002):
    """The loop's side: each window trains ``spw`` optimizer steps, then the weights are published."""
    trained, metrics, step = {}, [], 0
    for _ in range(windows):
        prompts, rollout, m = buffer.next(step)
        for p in prompts:
            assert p["_prompt_index"] not in trained, p  # never twice
            trained[p["_prompt_index"]] = step
        assert all(step - o.oldest_weight_version() <= buffer.max_staleness for o in rollout.outputs), (step, m)
        assert len(rollout.outputs) == G * buffer.groups_per_window and rollout.rewards_per_func.shape[0] == len(
            rollout.outputs
        )
        metrics.append(m)
        time.sleep(train_s)
        step += spw
        producer.weights_at = step
    return trained, metrics


def test_a_finished_group_trains_while_another_is_still_generating():
    producer, gate = FakeProducer(), {0: threading.Event()}
    buffer = _buffer(producer, [call(gate=gate)], k=2)
    try:
        prompts, _, m = buffer.next(0)
        assert not gate[0].is_set() and 0 in buffer.pending()  # group 0 is still generating
        assert 0 not in [p["_prompt_index"] for p in prompts] and m["async/groups_overtaken"] == 2
        gate[0].set()
        trained_at = {}
        for step in (1, 2):  # group 0 trains by step 2, when one more window would make it 3 steps old
            producer.weights_at = step
            prompts, _, m = buffer.next(step)
            trained_at.update({p["_prompt_index"]: step for p in prompts})
            assert m["async/staleness_max"] <= 2
        assert trained_at.get(0) in (1, 2), trained_at
    finally:
        buffer.drain()


@pytest.mark.parametrize("k, spw", [(1, 1), (2, 1), (4, 1), (4, 2)])
def test_wait_bounds_every_group_and_loses_none(k, spw):
    rng = random.Random(k * 10 + spw)
    delays = {}
    producer = FakeProducer()
    # a long tail: most groups quick, one in eight thirty times slower
    slow = call(delay=lambda pos: delays.setdefault(pos, 0.06 if rng.random() < 0.125 else 0.002))
    buffer = _buffer(producer, [slow, call(delay=lambda pos: 0.003)], k=k, spw=spw, per_window=3)
    try:
        trained, metrics = _train(buffer, producer, 25, spw=spw)
        frontier, pending = loop_position(buffer, producer.prompts)
    finally:
        buffer.drain()
    assert max(m["async/staleness_max"] for m in metrics) <= k
    assert sum(m["async/dropped"] for m in metrics) == 0
    assert sorted([*trained, *pending]) == list(range(frontier))  # each drawn prompt trained once or pending
    assert all(m["async/producer0_groups"] + m["async/producer1_groups"] == 3 for m in metrics)
    assert all(sum(m[f"async/producer{i}_groups"] for m in metrics) > 0 for i in (0, 1))  # both fed the windows


def test_drop_discards_groups_too_old_and_trains_their_prompts_later():
    producer = FakeProducer()
    slow = {3, 4}  # these two take long enough to be more than K = 1 step old when they finish
    buffer = _buffer(producer, [call(delay=lambda pos: 0.4 if pos in slow else 0.0)], k=1, policy="drop")
    try:
        trained, metrics = _train(buffer, producer, 12, train_s=0.05)
        frontier, pending = loop_position(buffer, producer.prompts)
    finally:
        buffer.drain()
    assert sum(m["async/dropped"] for m in metrics) >= G  # at least one of them came back too old
    assert max(m["async/staleness_max"] for m in metrics) <= 1
    assert slow <= set(trained) | set(pending)  # drawn again after the drop, never lost
    assert sorted([*trained, *pending]) == list(range(frontier))


def test_a_slow_producer_does_not_hold_back_the_other():
    producer = FakeProducer()
    gate = {pos: threading.Event() for pos in range(1000)}
    stuck = call(gate=gate)  # never answers until released
    buffer = _buffer(producer, [stuck, call()], k=2, per_window=2)
    try:
        _, _, m = buffer.next(0)
        assert m["async/producer1_groups"] == 2 and m["async/producer0_groups"] == 0
    finally:
        for event in gate.values():
            event.set()
        buffer.drain()


def test_dynamic_sampling_skips_groups_without_signal():
    producer = FakeProducer(flat=lambda pos: pos % 3 == 0)  # every third group has all-equal rewards
    buffer = _buffer(producer, [call()], k=2, per_window=4, dynamic_sample=True, max_resample_times=1)
    try:
        trained, metrics = _train(buffer, producer, 6)
    finally:
        buffer.drain()
    assert len(trained) == 6 * 4 and not any(pos % 3 == 0 for pos in trained)  # every flat group skipped
    assert all(m["async/staleness_max"] <= 2 for m in metrics)


def test_dynamic_sampling_metrics_and_filler_when_resampling_runs_out():
    producer = FakeProducer(flat=lambda pos: True)  # no group has a signal
    buffer = _buffer(producer, [call()], k=2, per_window=2, dynamic_sample=True, max_resample_times=2)
    try:
        _, rollout, _ = buffer.next(0)
    finally:
        buffer.drain()
    assert rollout.sampled == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/groups_without_signal": 2.0}


def test_a_failing_call_is_raised_on_the_loop():
    producer = FakeProducer()
    buffer = _buffer(producer, [call(fail_at=0)], k=1)
    try:
        with pytest.raises(RuntimeError, match="went away"):
            buffer.next(0)
    finally:
        buffer.drain()


def test_drain_cancels_calls_in_flight_and_keeps_their_prompts_pending():
    producer, log = FakeProducer(), []
    gate = {pos: threading.Event() for pos in range(2, 1000)}
    buffer = _buffer(producer, [call(gate=gate, log=log)], k=2)
    buffer.next(0)
    t0 = time.perf_counter()
    buffer.drain()
    assert time.perf_counter() - t0 < 5
    pending = buffer.pending()  # cancelled, never answered, still owed
    assert log == [0, 1] and pending[:2] == [2, 3] and pending == list(range(2, 2 + len(pending)))


def test_a_windowed_checkpoint_replays_prompt_by_prompt_and_the_reverse_is_refused():
    stream = PromptStream(list(range(100)), 1, seed=0, shuffle=False)
    stream.restore({"prompts_consumed": 12, "prompts_pending": [4, 8], "prompts_per_draw": 4})
    assert stream.replay == [4, 5, 6, 7, 8, 9, 10, 11]
    windowed = PromptStream(list(range(100)), 4, seed=0, shuffle=False)
    with pytest.raises(ConfigError, match="--stream_groups true"):
        windowed.restore({"prompts_consumed": 12, "prompts_pending": [5], "prompts_per_draw": 1})
    windowed.restore({"prompts_consumed": 12, "prompts_pending": [], "prompts_per_draw": 1})  # nothing owed: fine
    assert windowed.position == 12


def test_stream_groups_needs_asynchronous_training_and_one_process():
    plan = SimpleNamespace(optimizer_steps_per_window=2, world_size=1)
    r = SimpleNamespace(stream_groups=True, async_generate=False)
    with pytest.raises(ConfigError, match="--max_staleness K"):
        check_stream_groups(r, plan)
    r.async_generate = True
    check_stream_groups(r, plan)
    with pytest.raises(ConfigError, match="2 processes: not implemented yet"):
        check_stream_groups(r, SimpleNamespace(optimizer_steps_per_window=2, world_size=2))
    assert BatchPlan  # the real plan type the rules take
