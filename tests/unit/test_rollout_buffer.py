"""The buffer of --max_staleness drawing whole windows, against a fake producer whose speed the test sets: the
staleness bound under ``wait`` and ``drop``, what each counts, and that every window drawn is trained once or
pending (never lost, never twice), across a checkpoint's pending list and the stream's restore."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
import torch

from grpokit.config.async_rules import check_staleness
from grpokit.config.plan import BatchPlan
from grpokit.errors import ConfigError
from grpokit.protocol import ChatCompletionResponse, RolloutOutput
from grpokit.trainers.group_buffer import GroupBuffer, loop_position
from grpokit.trainers.prompts import PromptStream
from grpokit.trainers.window import WindowRollout

PER_WINDOW = 2


class FakeProducer:
    """The parts of a WindowProducer the buffer uses: the prompt stream, ``weights_at`` and ``rollout``, which
    takes ``delay_s`` and tags each output with the version it is given."""

    def __init__(self, n_prompts: int = 400, delay_s: float = 0.0, fail_at: int | None = None) -> None:
        self.prompts = PromptStream([{"q": i} for i in range(n_prompts)], PER_WINDOW, seed=0, shuffle=False)
        self.weights_at, self.delay_s, self.fail_at, self.calls = 0, delay_s, fail_at, 0

    def rollout(self, prompts, version=None):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise RuntimeError("the engine went away")
        time.sleep(self.delay_s)
        outputs = [
            RolloutOutput(
                response=ChatCompletionResponse(choices=[]),
                messages=[],
                weight_versions=[[version]],
                prompt_id=str(p["_prompt_index"]),
            )
            for p in prompts
        ]
        return WindowRollout([], outputs, torch.zeros(len(outputs), 1), {"rollout": self.delay_s, "reward": 0.0})

    async def rollout_groups(self, prompts, version, *, beside=None):
        return await asyncio.to_thread(self.rollout, prompts, version)


def _buffer(producer: FakeProducer, k: int, policy: str = "wait") -> GroupBuffer:
    """The buffer as a run without --stream_groups makes it: each draw a whole window, one optimizer step each."""
    calls = [producer.rollout_groups]
    return GroupBuffer(
        producer,
        calls,
        max_staleness=k,
        steps_per_window=1,
        groups_per_window=PER_WINDOW,
        groups_per_draw=PER_WINDOW,
        policy=policy,
    )


def _train(buffer: GroupBuffer, producer: FakeProducer, steps: int, train_s: float) -> tuple[list, list[dict]]:
    """The loop's side: take a window, 'train' it (one optimizer step), publish the new weights."""
    trained, metrics = [], []
    for step in range(steps):
        prompts, rollout, m = buffer.next(step)
        assert all(step - v <= buffer.max_staleness for o in rollout.outputs for v in o.weight_versions[0]), (step, m)
        trained.append(prompts[0]["_prompt_index"])
        metrics.append(m)
        time.sleep(train_s)
        producer.weights_at = step + 1
    return trained, metrics


@pytest.mark.parametrize("k", [1, 2, 4])
def test_wait_never_drops_and_the_producer_waits_when_it_is_faster(k):
    producer = FakeProducer(delay_s=0.0)
    buffer = _buffer(producer, k)
    try:
        trained, metrics = _train(buffer, producer, 12, train_s=0.01)
    finally:
        buffer.drain()
    assert trained == [PER_WINDOW * i for i in range(12)]  # in order, none skipped, none twice
    assert sum(m["async/dropped"] for m in metrics) == 0
    assert sum(m["async/producer_waits"] for m in metrics) > 0
    assert max(m["async/staleness_max"] for m in metrics) == k  # a fast producer runs the full bound ahead
    assert metrics[0]["async/staleness_max"] == 0
    assert [m["async/staleness_mean"] for m in metrics[k:]] == [k] * (12 - k)


def test_drop_discards_windows_too_old_and_trains_their_prompts_later():
    producer = FakeProducer(delay_s=0.0)
    buffer = _buffer(producer, 1, "drop")
    try:
        trained, metrics = _train(buffer, producer, 12, train_s=0.01)
        frontier, pending = loop_position(buffer, producer.prompts)
    finally:
        buffer.drain()
    dropped = sum(m["async/dropped"] for m in metrics)
    assert dropped > 0 and dropped % PER_WINDOW == 0  # whole windows
    assert len(set(trained)) == len(trained)  # never twice
    # every window up to the frontier is trained or pending: a dropped window's prompts came back
    assert sorted(trained + pending) == list(range(0, frontier, PER_WINDOW))
    assert loop_position(buffer, producer.prompts) == (frontier, pending)


def test_a_slow_producer_makes_the_loop_wait_and_says_so():
    producer = FakeProducer(delay_s=0.05)
    buffer = _buffer(producer, 1)
    try:
        _, metrics = _train(buffer, producer, 4, train_s=0.0)
    finally:
        buffer.drain()
    assert all(m["async/wait_s"] > 0.02 for m in metrics)
    assert all(m["async/buffer_fill"] == 0 for m in metrics)


def test_pending_windows_are_drawn_again_first_after_a_restore():
    producer = FakeProducer(delay_s=0.0)
    buffer = _buffer(producer, 2)
    try:
        trained, _ = _train(buffer, producer, 5, train_s=0.01)
        loop = dict(zip(("prompts_consumed", "prompts_pending"), loop_position(buffer, producer.prompts), strict=True))
    finally:
        buffer.drain()
    assert loop["prompts_pending"], "a fast producer has windows ahead"
    resumed = FakeProducer()
    assert resumed.prompts.restore(loop) == loop["prompts_consumed"]
    again = _buffer(resumed, 2)
    try:
        after, _ = _train(again, resumed, 4, train_s=0.0)
    finally:
        again.drain()
    assert after[: len(loop["prompts_pending"])] == loop["prompts_pending"]
    assert sorted(trained + after) == list(range(0, PER_WINDOW * 9, PER_WINDOW))  # exactly once, in all


class _CheckpointMoment(PromptStream):
    """A stream whose frontier, once ``arm``ed and read by the test's thread (a checkpoint reading it), first lets
    the producer finish the rollout it is held in (``release``) and waits, 0.5 s at most, for the producer to draw
    its next window: the producer drawing in the middle of a checkpoint."""

    def __init__(self, *args, **kwargs) -> None:
        self.release, self._drawn, self._reader = threading.Event(), threading.Event(), None
        super().__init__(*args, **kwargs)

    def arm(self) -> None:
        self._drawn.clear()
        self._reader = threading.get_ident()

    @property
    def position(self) -> int:
        if self._reader == threading.get_ident():
            self._reader = None
            self.release.set()
            self._drawn.wait(0.5)
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        self._position = value
        self._drawn.set()


class _HeldProducer(FakeProducer):
    """Its second rollout is held until the stream's ``release``; ``held`` says it got there."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts = _CheckpointMoment([{"q": i} for i in range(40)], PER_WINDOW, seed=0, shuffle=False)
        self.held = threading.Event()

    def rollout(self, prompts, version=None):
        if self.calls == 1:
            self.held.set()
            assert self.prompts.release.wait(10)
        return super().rollout(prompts, version)


def test_a_checkpoint_reads_frontier_and_pending_at_one_instant():
    """A window the producer draws while a checkpoint is taken is behind the saved frontier and pending, or past
    the frontier; never behind it and not pending (a resume would skip it: read one after the other, the pending
    list said [2] and the frontier 6, and window 4 was in neither)."""
    producer = _HeldProducer()
    buffer = _buffer(producer, 2)
    try:
        trained = [buffer.next(0)[0][0]["_prompt_index"]]  # window 0; the producer then rolls out window 2
        assert producer.held.wait(10)
        producer.prompts.arm()
        frontier, pending = loop_position(buffer, producer.prompts)
    finally:
        producer.prompts.release.set()
        buffer.drain()
    assert (frontier, pending) == (2 * PER_WINDOW, [PER_WINDOW])
    assert sorted(trained + pending) == list(range(0, frontier, PER_WINDOW))


def test_a_producer_error_reaches_the_loop_and_drain_returns():
    producer = FakeProducer(fail_at=2)
    buffer = _buffer(producer, 1)
    buffer.next(0)
    with pytest.raises(RuntimeError, match="went away"):
        buffer.next(1)
    done = threading.Event()
    threading.Thread(target=lambda: (buffer.drain(), done.set()), daemon=True).start()
    assert done.wait(5)
    assert buffer.pending() == [PER_WINDOW]  # the window whose rollout failed was never trained


def test_the_bound_is_at_least_one_window():
    plan = BatchPlan(
        world_size=1,
        num_generations=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        steps_per_generation=2,
        num_iterations=1,
    )
    r = type("R", (), {"max_staleness": 1, "staleness_policy": "drop"})()
    with pytest.raises(
        ConfigError, match="--max_staleness 1: one window trains 2 optimizer steps.*use --max_staleness 2 or more"
    ):
        check_staleness(r, plan)
    r.max_staleness = 2
    check_staleness(r, plan)
    r.max_staleness = 0
    check_staleness(r, plan)
    r.max_staleness, plan = 2, dataclasses.replace(plan, world_size=2)
    with pytest.raises(ConfigError, match="--staleness_policy drop with 2 processes: not implemented yet"):
        check_staleness(r, plan)
    r.staleness_policy = "wait"
    check_staleness(r, plan)


@pytest.mark.parametrize(
    "server, vllm, async_, regex, error",
    [
        (False, False, True, None, "implemented in server mode .* and for vLLM colocate"),
        (False, True, True, None, None),  # vLLM colocate: a sync pauses the producer's batch
        (True, False, False, None, "add --max_staleness K"),
        (True, False, True, "[0-9]+", "a grammar cannot resume"),
        (True, False, True, None, None),
    ],
)
def test_partial_rollouts_need_a_pausable_engine_rolling_ahead_without_a_grammar(server, vllm, async_, regex, error):
    from types import SimpleNamespace

    from grpokit.config.async_rules import check_partial_rollouts

    r = SimpleNamespace(
        partial_rollouts=True,
        use_vllm=vllm,
        async_generate=async_,
        structured_outputs_regex=regex,
        structured_outputs_json=None,
    )
    if error is None:
        check_partial_rollouts(r, server)
    else:
        with pytest.raises(ConfigError, match=error):
            check_partial_rollouts(r, server)


def test_a_server_engine_that_cannot_pause_is_named():
    from grpokit.engines.client_calls import check_partial_rollouts

    check_partial_rollouts([{"engine_type": "transformers", "partial_rollouts": True}])
    with pytest.raises(ConfigError, match="not implemented for the rollout server's vllm engine"):
        check_partial_rollouts([{"engine_type": "transformers", "partial_rollouts": True}, {"engine_type": "vllm"}])
