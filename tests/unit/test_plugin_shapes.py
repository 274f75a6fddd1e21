"""Objects a plugin touches, shaped like ms-swift's (attribute and dict access), and TRL's calling convention."""

from __future__ import annotations

import asyncio
import json

import pytest

from grpokit.errors import ConfigError, RewardError, RolloutError
from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RolloutInferRequest, RolloutOutput
from grpokit.rewards import RewardRunner, TrainerStateView, check_reward_columns, trl_convention
from grpokit.rewards.calling import RewardLog, RewardLogBook, check_signature, convention
from grpokit.rollout.env import Env, envs, reset_values, start_messages

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def choice(text: str = "4") -> ChatCompletionResponseChoice:
    return ChatCompletionResponseChoice(
        message={"role": "assistant", "content": text}, finish_reason="stop", token_ids=[1, 2]
    )


# -- choice.message ----------------------------------------------------------------------------------------------
def test_message_reads_by_attribute_and_as_a_dict_and_serialises_unchanged():
    c = choice("four")
    assert c.message.content == c.message["content"] == c.message.get("content") == "four"
    assert c.message.role == "assistant" and c.message.tool_calls is None and c.message.reasoning_content is None
    c.message.content += "!"  # ms-swift plugins edit it by attribute
    assert c.message == {"role": "assistant", "content": "four!"} and {**c.message}["content"] == "four!"
    with pytest.raises(AttributeError, match="message has no 'nope'"):
        _ = c.message.nope
    wire = json.loads(ChatCompletionResponse(choices=[c]).model_dump_json())
    assert wire["choices"][0]["message"] == {"role": "assistant", "content": "four!"}
    back = ChatCompletionResponse.model_validate(wire)
    assert back.choices[0].message.content == "four!"
    # goes into a message list as a plain message (a scheduler's usual move)
    out = RolloutOutput(response=back, messages=[*PROMPT, c.message])
    assert out.messages[-1] == {"role": "assistant", "content": "four!"}


# -- trainer_state -----------------------------------------------------------------------------------------------
def test_trainer_state_reads_by_attribute_and_as_a_dict():
    state = TrainerStateView(global_step=3, max_steps=10)
    assert state.global_step == state["global_step"] == state.get("global_step") == 3
    assert state.max_steps == 10 and state.get("epoch", 0) == 0 and "max_steps" in state
    assert state == {"global_step": 3, "max_steps": 10}


def test_runner_hands_rewards_a_trainer_state_object():
    seen = []

    def by_attr(completions, trainer_state, **kwargs):  # ms-swift's plugins
        seen.append((trainer_state.global_step, trainer_state["max_steps"]))
        return [1.0] * len(completions)

    RewardRunner([by_attr], ["a"]).compute(["x"], {"trainer_state": {"global_step": 2, "max_steps": 5}})
    assert seen == [(2, 5)]


# -- Env.reset ---------------------------------------------------------------------------------------------------
def test_reset_takes_three_values_or_two():
    assert reset_values(("obs", {"k": 1}, "sys"), "e") == ("obs", {"k": 1}, "sys")
    assert reset_values(("obs", None), "e") == ("obs", {}, "")
    with pytest.raises(ValueError, match=r"env 'e': reset must return .* got 4 values"):
        reset_values(("a", {}, "", 1), "e")
    with pytest.raises(ValueError, match="observation must be a string, got int"):
        reset_values((3, {}), "e")


def test_env_messages_replace_the_prompt_as_in_ms_swift():
    assert start_messages(PROMPT, "new task", "You play.") == [
        {"role": "system", "content": "You play."},
        {"role": "user", "content": "new task"},
    ]
    assert start_messages(PROMPT, "new task", "") == [PROMPT[0], {"role": "user", "content": "new task"}]
    assert start_messages(PROMPT, "", "") == PROMPT  # nothing from the env: the row's prompt stays


def test_gym_scheduler_replaces_the_prompt_and_refuses_a_bad_reset():
    from grpokit.rollout.builtin_schedulers import GYMScheduler

    class ThreeValues(Env):
        async def reset(self, config):
            return "Pick a number.", {"seed": 1}, "You are a player."

        async def step(self, action):
            return "", 1.0, True, {}

    class Bad(ThreeValues):
        async def reset(self, config):
            return "just text"

    envs["three"], envs["bad_shape"] = ThreeValues, Bad
    sched = GYMScheduler(None, max_turns=1)
    req = RolloutInferRequest(messages=list(PROMPT), data_dict={"env_config": {"name": "three"}})
    asyncio.run(sched.on_trajectory_start([req]))
    assert req.messages == [
        {"role": "system", "content": "You are a player."},
        {"role": "user", "content": "Pick a number."},
    ]
    assert sched._episodes[req.request_id].reset_info == {"seed": 1}
    bad = RolloutInferRequest(messages=list(PROMPT), data_dict={"env_config": {"name": "bad_shape"}})
    with pytest.raises(RolloutError, match=r"env 'bad_shape' reset failed: ValueError: .*got str"):
        asyncio.run(sched.on_trajectory_start([bad]))


# -- TRL's calling convention ------------------------------------------------------------------------------------
def trl_first(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def trl_prompts(prompts, completions, task, **kwargs):  # TRL's standard format: strings
    return [None if t != "math" else float(p == "2+2?" and c == "0") for p, c, t in zip(prompts, completions, task)]


def swift_style(completions, solution, **kwargs):
    return [float(c == s) for c, s in zip(completions, solution)]


def trl_marked(completions, **kwargs):  # TRL's conversational format
    return [float(c[0]["content"] == "4") for c in completions]


trl_convention(trl_marked, conversational=True)


def test_convention_is_read_from_the_signature():
    assert convention(trl_first) == convention(trl_prompts) == convention(trl_marked) == "trl"
    assert convention(swift_style) == "swift"
    assert convention(lambda completions, log_metric=None, **kw: []) == "trl"
    assert convention(lambda *, completions: []) == "trl"  # keywords only: TRL calls by keyword

    class Swift:
        def __call__(self, completions, **kwargs):
            return []

    assert convention(Swift()) == "swift"


def test_a_signature_that_fits_neither_is_refused_before_training():
    with pytest.raises(ConfigError, match=r"--reward_funcs nothing: .* takes no arguments"):
        check_signature(lambda: [], "nothing")
    with pytest.raises(ConfigError, match=r"--reward_funcs posonly: .* prompts is positional-only"):
        check_reward_columns([lambda prompts, /, **kw: []], ["posonly"], set())

    def two_positional(completions, extra, /):
        return []

    with pytest.raises(ConfigError, match="positional-only parameters extra after the completions"):
        check_signature(two_positional, "two")
    # a TRL function naming a column the dataset lacks: the usual column check, TRL names count as supplied
    with pytest.raises(ConfigError, match=r"needs dataset column\(s\) task"):
        check_reward_columns([trl_prompts], ["multi"], {"solution"})
    check_reward_columns([trl_prompts, trl_first], ["multi", "len"], {"task"})


def _kwargs(n: int = 2) -> dict:
    full = [PROMPT + [{"role": "assistant", "content": str(k)}] for k in range(n)]
    return {
        "messages": full,
        "prompts": [PROMPT] * n,
        "completion_ids": [[1] * (k + 1) for k in range(n)],
        "task": ["math", "code"][:n],
        "solution": ["4", "4"][:n],
        "trainer_state": {"global_step": 0},
    }


def test_runner_calls_each_function_in_its_convention():
    runner = RewardRunner([trl_first, trl_prompts, swift_style, trl_marked], ["ids", "multi", "swift", "marked"])
    scores = runner.compute(["0", "4"], _kwargs())
    assert scores[:, 0].tolist() == [1.0, 2.0]  # completion_ids by keyword
    assert scores[0, 1].item() == 1.0 and scores[1, 1].isnan()  # prompt and completion texts; None = not scored
    assert scores[:, 2].tolist() == [0.0, 1.0]  # texts positionally
    # TRL's conversational completions: the messages after the prompt ("0" and "1" in the conversations)
    assert scores[:, 3].tolist() == [0.0, 0.0]
    assert RewardRunner([trl_marked], ["m"]).compute(["x", "4"], {"prompts": [PROMPT] * 2})[:, 0].tolist() == [0, 1]


def test_trl_async_function_and_log_hooks():
    async def judge(prompts, completions, log_extra=None, log_metric=None, **kwargs):
        log_extra("first_word", [c.split()[0] for c in completions])
        log_metric("accuracy", 0.5)
        return [1.0 for _ in completions]

    log = RewardLog(2)
    runner = RewardRunner([judge], ["judge"])
    try:
        assert runner.compute(["a b", "c"], {"prompts": [PROMPT] * 2}, log)[:, 0].tolist() == [1.0, 1.0]
    finally:
        runner.close()
    assert log.extra == {"first_word": ["a", "c"]} and log.metrics == {"accuracy": [0.5]}


def test_log_hooks_check_what_they_get():
    def short(completions, log_extra=None, **kwargs):
        log_extra("col", ["only one"])
        return [0.0] * len(completions)

    def nan_metric(completions, log_metric=None, **kwargs):
        log_metric("acc", float("nan"))
        return [0.0] * len(completions)

    with pytest.raises(
        RewardError,
        match=r"reward 'short': log_extra\('col', values\) needs one value per "
        r"completion \(2\), got 1 values",
    ):
        RewardRunner([short], ["short"]).compute(["a", "b"], {})
    with pytest.raises(RewardError, match=r"reward 'nan': log_metric\('acc', value\) needs a finite number"):
        RewardRunner([nan_metric], ["nan"]).compute(["a", "b"], {})


def test_log_book_keeps_records_until_their_window_and_drops_discarded_ones():
    book = RewardLogBook()
    first, second, third = RewardLog(2), RewardLog(2), RewardLog(1)
    first.extra["col"] = ["a", "b"]
    first.metrics["acc"] = [1.0]
    second.metrics["acc"] = [0.0, 0.5]
    book.add(["r1", "r2"], first)
    book.add(["r3", "r4"], second)  # e.g. a dynamic-sampling round whose groups were not kept
    book.add(["r5"], third)  # the next window's rollout, scored meanwhile
    extras, metrics = book.take(["r2", "r1", "r3"])
    assert extras == [{"col": "b"}, {"col": "a"}, {}] and metrics == {"acc": 0.5}
    assert book.take(["r5"]) == ([{}], {})
    assert book._by_id == {}  # r4 (never trained on) went with the older entries
    several = RewardLog(3)  # a custom run() returned two outputs for request "q"
    several.extra["col"] = ["q0", "q1", "p0"]
    book.add(["q", "q", "p"], several)
    assert book.take(["p", "q", "q"])[0] == [{"col": "p0"}, {"col": "q0"}, {"col": "q1"}]
