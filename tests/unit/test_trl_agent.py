"""TRL's tool-calling loop, environments and rollout_func on grpokit's schedulers, with a scripted engine (one
token per character, so any re-encoding would show): tools run (sync and async), their results come back as tool
messages whose tokens are not trained, the iteration limit holds, environments reset and score, and rollout_func's
completions and extra fields reach the trainer and the rewards."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_multi_turn import ScriptedEngine, encode, request, run_one, tiny_tokenizer

from grpokit.errors import RolloutError
from grpokit.protocol import RequestConfig
from grpokit.trl.agent import RolloutFuncScheduler, TrlToolScheduler, rollout_parts, with_rollout_fields
from grpokit.trl.config import GRPOConfig


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


async def times(a: int, b: int) -> int:
    """Multiply two numbers.

    Args:
        a: the first number
        b: the second number
    """
    await asyncio.sleep(0)
    return a * b


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def scheduler(reply, tools=(add, times), factories=None, max_iterations=None):
    return TrlToolScheduler(
        ScriptedEngine(tiny_tokenizer(), reply), tools=list(tools), factories=factories, max_iterations=max_iterations
    )


def test_tool_results_come_back_as_untrained_tool_messages():
    def reply(req):
        turn = sum(m["role"] == "assistant" for m in req.messages)
        return [call("add", a=2, b=3) + call("times", a=4, b=5), call("nope"), "It is 5."][turn]

    prompt = request("Add 2 and 3.")
    out = run_one(scheduler(reply), prompt, max_tokens=400)
    tool_messages = [m for m in out.messages if m["role"] == "tool"]
    assert [(m["name"], m["content"]) for m in tool_messages] == [
        ("add", "5"),
        ("times", "20"),
        ("nope", "{'error': 'Tool nope not found.'}"),
    ]
    assert out.messages[-1] == {"role": "assistant", "content": "It is 5."}
    assert out.rollout_infos["num_turns"] == 3 and out.rollout_infos["tool_failures"] == 1
    sample = encode(out, prompt.messages)
    pairs = list(zip(sample.completion_ids, sample.completion_mask, strict=True))
    untrained = tiny_tokenizer().decode([t for t, m in pairs if m == 0])
    trained = tiny_tokenizer().decode([t for t, m in pairs if m])
    assert "20" in untrained and "It is" not in untrained  # tool results are template tokens, not trained
    assert "tool_call" in trained and "20" not in trained


def test_max_tool_calling_iterations_bounds_the_rounds():
    out = run_one(scheduler(lambda req: call("add", a=1, b=1), max_iterations=1), request(), max_tokens=400)
    assert out.rollout_infos["num_turns"] == 2 and out.rollout_infos["tool_calls"] == 1  # one round's calls ran
    assert [m["role"] for m in out.messages] == ["user", "assistant", "tool", "assistant"]


class Counter:
    """An environment as TRL writes one: reset, a tool method, get_reward."""

    def reset(self, prompt, target, **kwargs):
        self.count, self.target = 0, target
        return " Count up."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: how much to add
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count == self.target)


def test_environment_resets_serves_tools_and_scores():
    sched = scheduler(
        lambda req: call("increment", step=3) if len(req.messages) < 3 else "ok", tools=(), factories={None: Counter}
    )
    prompt = request("Count.", target=3)
    out = run_one(sched, prompt, max_tokens=400)
    assert prompt.messages[-1]["content"] == "Count. Count up."  # reset's text, joined to the last message
    assert [m["content"] for m in out.messages if m["role"] == "tool"] == ["3"]
    scores = asyncio.run(sched.environment_reward(Counter)(request_id=[prompt.request_id, "other"]))
    assert scores == [1.0, None]


def test_rewards_get_environments_and_the_environment_reward_is_added():
    def wants_envs(completions, environments, **kwargs):
        return [float(e.count) for e in environments]

    recipe, rewards, schemas = rollout_parts(
        _cfg(), [add], Counter, None, GRPOConfig(), None, [("wants_envs", wants_envs)]
    )
    assert [n for n, _ in rewards] == ["wants_envs", "Counter"]
    assert [s["function"]["name"] for s in schemas[None]] == ["add", "increment"]
    sched = recipe(
        ScriptedEngine(tiny_tokenizer(), lambda req: call("increment", step=2) if len(req.messages) < 3 else "ok")
    )
    prompt = request("Count.", target=2)
    run_one(sched, prompt, max_tokens=400)
    assert rewards[0][1](completions=["x"], request_id=[prompt.request_id]) == [2.0]
    assert asyncio.run(rewards[1][1](request_id=[prompt.request_id])) == [1.0]


def _cfg():
    from grpokit.config.parse import parse_train_args

    return parse_train_args(["--model", "m/x", "--num_generations", "2"])


def test_rollout_func_fills_each_group_and_forwards_its_fields():
    tok = tiny_tokenizer()
    seen = []

    def rollout_func(prompts, trainer):
        seen.append(prompts)
        ids = tok("hi", add_special_tokens=False)["input_ids"]
        return {
            "prompt_ids": [[1]] * 4,
            "completion_ids": [ids] * 4,
            "logprobs": [[-0.5] * len(ids)] * 4,
            "env_mask": [[1] * len(ids)] * 4,
            "judge": ["a", "b", "c", "d"],
        }

    owner = type("Owner", (), {"processing_class": None})()
    sched = RolloutFuncScheduler(
        ScriptedEngine(tok, lambda r: ""), rollout_func=rollout_func, owner=owner, num_generations=2
    )
    reqs = [request("p0"), request("p1")]
    group = [
        reqs[0],
        reqs[0].model_copy(update={"request_id": "r1"}),
        reqs[1],
        reqs[1].model_copy(update={"request_id": "r3"}),
    ]
    outs = asyncio.run(sched.async_infer(group, RequestConfig()))
    assert [[m["content"] for m in p] for p in seen[0]] == [["p0"], ["p1"]]  # each prompt once
    assert len(outs) == 4 and outs[0].messages[-1]["content"] == "hi" and owner.processing_class is tok
    reward = with_rollout_fields(lambda completions, judge, **kwargs: [ord(j) for j in judge])
    assert reward(completions=["hi"] * 4, rollout_infos=[o.rollout_infos for o in outs]) == [97, 98, 99, 100]
    bad = RolloutFuncScheduler(None, rollout_func=lambda p, t: {"prompt_ids": []}, owner=owner, num_generations=2)
    with pytest.raises(RolloutError, match="must return a dict with prompt_ids, completion_ids, logprobs"):
        asyncio.run(bad.async_infer(group, RequestConfig()))


def test_a_failing_environment_or_rollout_func_is_named_in_one_line():
    class Broken:
        def reset(self, **kwargs):
            raise KeyError("target")

    with pytest.raises(RolloutError, match=r"^environment Broken\.reset\(\) raised KeyError: 'target'$"):
        run_one(scheduler(lambda req: "ok", tools=(), factories={None: Broken}), request(), max_tokens=50)

    def my_rollout(prompts, trainer):
        raise ValueError("server down")

    owner = type("Owner", (), {"processing_class": object()})()
    sched = RolloutFuncScheduler(None, rollout_func=my_rollout, owner=owner, num_generations=2)
    with pytest.raises(RolloutError, match=r"^rollout_func my_rollout\(\) raised ValueError: server down$"):
        asyncio.run(sched.async_infer([request()], RequestConfig()))
