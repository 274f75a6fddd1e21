"""One async path: K = 0 goes through the same buffer as --max_staleness; the loop's own rollout and the buffer's
calls are one producer call (``rollout_groups``) and take turns on the engine; old/ref logps come from the plain
logps function unless a subclass overrides the forward's hooks."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from grpokit.aio import run_sync
from grpokit.config.args import AlgorithmArguments, RolloutArguments
from grpokit.protocol import ChatCompletionResponse, RolloutOutput
from grpokit.trainers import hooks
from grpokit.trainers.group_buffer import GroupBuffer
from grpokit.trainers.grpo_trainer import GRPOTrainer
from grpokit.trainers.prompts import PromptStream
from grpokit.trainers.rollouts import EngineTurns, Rewards, Rollouts, WindowHooks

USER = [{"role": "user", "content": "hi"}]


class GatedScheduler:
    """An engine whose calls wait for ``gate`` when ``held``; records the order calls start and end in."""

    def __init__(self) -> None:
        self.gate, self.held, self.log = threading.Event(), False, []

    async def async_infer(self, requests, config):
        name = requests[0].data_dict["who"]
        self.log.append(f"{name} starts")
        while self.held and not self.gate.is_set():
            await asyncio.sleep(0.005)
        self.log.append(f"{name} ends")
        return [
            RolloutOutput(response=ChatCompletionResponse(choices=[]), messages=[], request_id=r.request_id)
            for r in requests
        ]


def _rollouts(scheduler) -> Rollouts:
    rewards = Rewards(["r"], torch.ones(1), runner=None, uses_env_reward=False)
    stream = PromptStream([{"messages": USER, "who": "x"}] * 8, 1, seed=0, shuffle=False)
    hook = WindowHooks(logps=lambda *a, **k: None, progress=dict, score=lambda req, out: torch.ones(len(out), 1))
    template = SimpleNamespace(with_system=lambda messages: messages, multimodal=False)
    args = RolloutArguments(num_generations=2)
    return Rollouts(
        hook,
        stream,
        scheduler=scheduler,
        template=template,
        rewards=rewards,
        rollout_args=args,
        algorithm=AlgorithmArguments(),
    )


def test_synchronous_training_draws_through_the_same_buffer():
    producer = _rollouts(GatedScheduler())
    buffer = GroupBuffer(
        producer,
        [producer.rollout_groups],
        max_staleness=0,
        steps_per_window=1,
        groups_per_window=1,
        groups_per_draw=1,
        policy="wait",
    )
    prompts, rollout, metrics = buffer.next(0)
    assert rollout is None and metrics == {}  # the loop rolls its window out itself, on the weights just synced
    assert [p["_prompt_index"] for p in prompts] == [0]
    assert buffer.loop_position() == (1, []) and buffer.pending() == []
    buffer.drain()


def test_the_loops_rollout_and_the_buffers_call_are_one_call_taking_turns_on_the_engine():
    scheduler = GatedScheduler()
    producer = _rollouts(scheduler)
    producer.weights_at = 3
    scheduler.held = True
    scorer = ThreadPoolExecutor(1)  # the buffer scores beside its event loop
    buffer_prompts = [{"messages": USER, "who": "buffer", "_prompt_index": 0}]
    background = threading.Thread(target=lambda: run_sync(producer.rollout_groups(buffer_prompts, 2, beside=scorer)))
    background.start()
    while "buffer starts" not in scheduler.log:
        assert background.is_alive(), "the buffer's call ended before reaching the engine"
        time.sleep(0.005)
    done = []
    loop_call = threading.Thread(
        target=lambda: done.append(producer.rollout([{"messages": USER, "who": "loop", "_prompt_index": 1}]))
    )
    loop_call.start()
    time.sleep(0.1)
    assert scheduler.log == ["buffer starts"]  # the loop's rollout waits for the buffer's call on the engine
    scheduler.gate.set()
    background.join(5)
    loop_call.join(5)
    scorer.shutdown()
    assert scheduler.log == ["buffer starts", "buffer ends", "loop starts", "loop ends"]
    (rollout,) = done
    assert [o.weight_versions for o in rollout.outputs] == [[[3]], [[3]]]  # the engine's version now
    assert rollout.rewards_per_func.shape == (2, 1) and set(rollout.timing) == {"rollout", "reward"}


def test_a_waiting_exclusive_turn_holds_back_new_shared_ones():
    turns, log = EngineTurns(), []

    async def shared(name, hold_s):
        async with turns.hold(exclusive=False):
            log.append(f"{name} in")
            await asyncio.sleep(hold_s)
            log.append(f"{name} out")

    async def exclusive():
        async with turns.hold(exclusive=True):
            log.append("loop in")
            log.append("loop out")

    async def scene():
        first = asyncio.ensure_future(shared("a", 0.05))
        await asyncio.sleep(0.01)
        loop = asyncio.ensure_future(exclusive())
        await asyncio.sleep(0.01)
        later = asyncio.ensure_future(shared("b", 0.0))
        await asyncio.gather(first, loop, later)

    run_sync(scene())
    assert log == ["a in", "a out", "loop in", "loop out", "b in", "b out"]


class PlainTrainer(GRPOTrainer):
    pass


class OwnForward(GRPOTrainer):
    def _prepare_model_inputs(self, inputs):
        return super()._prepare_model_inputs(inputs)


def test_logps_are_the_plain_function_unless_a_subclass_overrides_the_forward():
    plain = object()
    for cls, expect_plain in ((PlainTrainer, True), (OwnForward, False)):
        trainer = object.__new__(cls)
        got = hooks.window_hooks(trainer, GRPOTrainer, plain).logps
        if expect_plain:
            assert got is plain
        else:
            assert got.__func__ is GRPOTrainer._get_per_token_logps_and_entropies and got.__self__ is trainer
