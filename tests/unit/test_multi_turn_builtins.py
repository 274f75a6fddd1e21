"""The built-in schedulers (tool calls, math tips, thinking tips, gym) and the safe calculator, with the scripted
one-token-per-character engine of test_multi_turn.py, checked token by token through ChatTemplate.encode_output."""

from __future__ import annotations

import logging

import pytest
from test_multi_turn import ScriptedEngine, char_ids, encode, n_assistant, request, run_one, tiny_tokenizer

from grpokit.errors import ConfigError, DataError, RolloutError
from grpokit.protocol import RequestConfig
from grpokit.rollout.builtin_schedulers import (
    GYMScheduler,
    MathTipsScheduler,
    ThinkingTipsScheduler,
    ToolCallScheduler,
    cut_token_prefix,
    strip_think,
)
from grpokit.rollout.env import Env, GuessNumberEnv, envs
from grpokit.rollout.scheduler import run_trajectories
from grpokit.rollout.tools import ToolError, calculator, parse_action, run_tool


def gap_ids(tok, role: str, text: str) -> list[int]:
    """Template text after an assistant message that ended with eos, up to the next assistant header."""
    return tok(f"\n<|im_start|>{role}\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
        "input_ids"
    ]


# -- tool_call_scheduler -------------------------------------------------------------------------------------------
def test_tool_results_are_masked_and_model_tokens_kept_exactly():
    tok = tiny_tokenizer()
    script = {
        0: "Let me use the tool.\nAction: calculator\nAction Input: 3+4",
        1: "Action: calculator\nAction Input: (3+4)*5",
        2: "The answer is 35.",
    }
    engine = ScriptedEngine(tok, lambda r: script[n_assistant(r)])
    prompt = request("Compute (3+4)*5 with the calculator.")
    out = run_one(ToolCallScheduler(engine, max_turns=5, tokenizer=tok), prompt)
    p1, p2, p3 = engine.produced
    assert [m["content"] for m in out.messages if m["role"] == "user"][1:] == ["Observation: 7", "Observation: 35"]
    assert out.response_token_ids == [p1, p2, p3]
    assert out.rollout_infos["tool_calls"] == 2 and out.rollout_infos["tool_errors"] == 0
    assert out.rollout_infos["stop_reason"] == "finished"  # the third reply has no Action
    enc = encode(out, prompt.messages)
    g1, g2 = gap_ids(tok, "user", "Observation: 7"), gap_ids(tok, "user", "Observation: 35")
    assert enc.completion_ids == p1 + g1 + p2 + g2 + p3
    assert enc.completion_mask == [1] * len(p1) + [0] * len(g1) + [1] * len(p2) + [0] * len(g2) + [1] * len(p3)
    # the engine was asked to stop before writing its own observation
    assert all("Observation:" in cfg.stop for _, cfg in engine.calls)


def test_tool_errors_become_observations():
    tok = tiny_tokenizer()
    script = {
        0: "Action: search\nAction Input: cats",
        1: "Action: calculator\nAction Input: __import__('os')",
        2: "I give up.",
    }
    engine = ScriptedEngine(tok, lambda r: script[n_assistant(r)])
    out = run_one(ToolCallScheduler(engine, max_turns=5, tokenizer=tok), request())
    obs = [m["content"] for m in out.messages if m["role"] == "user"][1:]
    assert obs[0] == "Observation: error: unknown tool 'search'; available tools: calculator"
    assert obs[1].startswith("Observation: error: unsupported expression element Call")
    assert out.rollout_infos["tool_errors"] == 2


@pytest.mark.parametrize(
    "expr, want",
    [
        ("3+4", "7"),
        ("(3+4)*5", "35"),
        ("2**10", "1024"),
        ("7/2", "3.5"),
        ("-7 % 3", "2"),
        ("2^3", "8"),
        ("1/3", "0.333333333333"),
        ("4/2", "2"),
    ],
)
def test_calculator_values(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize(
    "expr, why",
    [
        ("9**9**9", "exponent 387420489 is larger than 1000"),
        ("1/0", "division by zero"),
        ("__import__('os').system('true')", "unsupported expression element Call"),
        ("x + 1", "element Name"),
        ("(-8)**0.5", "not a real number"),
        ("1e308*10", "not a finite number"),
        ("", "empty expression"),
        ("(10**999)**999", "result too large"),
        ("True + 1", "element Constant"),
        ("1 +", "cannot parse"),
    ],
)
def test_calculator_refuses(expr, why):
    with pytest.raises(ToolError, match=why.replace("(", r"\(").replace("*", r"\*")):
        calculator(expr)


def test_parse_action_takes_the_last_call_and_ignores_observation_suffix():
    text = "Action: calculator\nAction Input: 1+1\nObservation: 2\nAction: calculator\nAction Input: 2*3 Observation:"
    assert parse_action(text) == ("calculator", "2*3")
    assert parse_action("no tool here") is None
    assert run_tool("calculator", "2*3") == "6"


# -- math_tip_trick ------------------------------------------------------------------------------------------------
def test_math_tip_cuts_before_the_answer_and_masks_the_tip():
    tok = tiny_tokenizer()
    first = "<think>2 plus 2 is 5</think><answer>5</answer>"
    second = " so 2 plus 2 is 4</think><answer>4</answer>"
    engine = ScriptedEngine(tok, lambda r: first if n_assistant(r) == 0 else second)
    prompt = request("What is 2 + 2?", solution="4")
    sched = MathTipsScheduler(engine, max_turns=3, tokenizer=tok)
    out = run_one(sched, prompt, logprobs=True)
    p1, p2 = engine.produced
    kept = len("<think>2 plus 2 is 5")  # one token per character, cut before </think>
    tip = tok(sched.tips_prompt, add_special_tokens=False)["input_ids"]
    assert out.response_token_ids == [p1[:kept] + tip + p2]  # one assistant message: one segment
    assert out.response_loss_mask == [[1] * kept + [0] * len(tip) + [1] * len(p2)]
    # turn 2 continued the cut message with the tip
    assert engine.calls[1][0][-1] == {"role": "assistant", "content": "<think>2 plus 2 is 5" + sched.tips_prompt}
    assert out.messages[-1]["content"] == "<think>2 plus 2 is 5" + sched.tips_prompt + second
    assert out.rollout_infos["num_turns"] == 2 and out.rollout_infos["tips_given"] == 1
    # logprobs: the kept 20 tokens of turn 1 (-0.01 .. -0.20), then all of turn 2
    assert out.rollout_logprobs == [[-(k + 1) / 100 for k in range(kept)] + [-(k + 1) / 100 for k in range(len(p2))]]
    enc = encode(out, prompt.messages)
    assert enc.completion_ids == out.response_token_ids[0]
    assert enc.completion_mask == out.response_loss_mask[0]


def test_math_tip_stops_at_once_when_correct_and_needs_solution():
    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, lambda r: "<answer>4</answer>")
    out = run_one(MathTipsScheduler(engine, max_turns=3, tokenizer=tok), request("2+2?", solution="4"))
    assert len(engine.calls) == 1 and out.rollout_infos["num_turns"] == 1
    with pytest.raises(DataError, match="'solution' column"):
        run_one(MathTipsScheduler(engine, max_turns=3, tokenizer=tok), request("2+2?"))


def test_cut_token_prefix_drops_trailing_special_tokens():
    tok = tiny_tokenizer()
    ids = char_ids(tok, "abc") + [tok.eos_token_id]
    assert cut_token_prefix(tok, ids, "abc", 3) == 3  # no tag: everything but the eos
    merged = tok("hello world", add_special_tokens=False)["input_ids"]
    k = cut_token_prefix(tok, merged, "hello world", 5)
    assert "hello world".startswith(tok.decode(merged[:k])) and len(tok.decode(merged[:k])) <= 5


# -- thinking_tips_scheduler ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_scale", ["default", "last_round"])
def test_thinking_tips_one_output_per_round(loss_scale):
    tok = tiny_tokenizer()
    replies = ["<think>hmm</think><answer>5</answer>", "<think>again</think><answer>4</answer>"]
    engine = ScriptedEngine(tok, lambda r: replies[n_assistant(r)])
    prompt = request("What is 2 + 2?", solution="4")
    sched = ThinkingTipsScheduler(engine, max_turns=3, tokenizer=tok, loss_scale=loss_scale)
    outs = run_one(sched, prompt, logprobs=True)
    p1, p2 = engine.produced
    assert len(outs) == 2 and [o.rollout_infos["round"] for o in outs] == [1, 2]
    # round 2 saw round 1's reply without its thinking, then the tip
    assert engine.calls[1][0][1:] == [
        {"role": "assistant", "content": "<answer>5</answer>"},
        {"role": "user", "content": sched.tips_prompt},
    ]
    hist = tok("<answer>5</answer>", add_special_tokens=False)["input_ids"]
    first_trains = int(loss_scale == "default")
    assert outs[0].response_token_ids == [p1] and outs[0].response_loss_mask == [[first_trains] * len(p1)]
    assert outs[1].response_token_ids == [hist, p2]
    assert outs[1].response_loss_mask == [[0] * len(hist), [1] * len(p2)]
    assert outs[1].rollout_logprobs == [[], [-(k + 1) / 100 for k in range(len(p2))]]
    assert outs[0].rollout_logprobs == ([[-(k + 1) / 100 for k in range(len(p1))]] if first_trains else [])
    enc = encode(outs[1], prompt.messages)  # history reply (mask 0) + template gap (mask 0) + round 2 (mask 1)
    gap = tok(
        f"<|im_end|>\n<|im_start|>user\n{sched.tips_prompt}<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )["input_ids"]
    assert enc.completion_ids == hist + gap + p2
    assert enc.completion_mask == [0] * (len(hist) + len(gap)) + [1] * len(p2)


def test_strip_think():
    assert strip_think("<think>a\nb</think>\n<answer>1</answer>") == "<answer>1</answer>"
    assert strip_think("x <think>never closed") == "x"


# -- gym_scheduler -------------------------------------------------------------------------------------------------
def test_gym_guess_number_rewards_and_masks():
    tok = tiny_tokenizer()
    guesses = ["8", "I guess 2", "3"]
    engine = ScriptedEngine(tok, lambda r: guesses[n_assistant(r)])
    prompt = request("Guess a number from 1 to 16.", env_config={"name": "guess_number", "secret": 3})
    out = run_one(GYMScheduler(engine, max_turns=5, tokenizer=tok), prompt)
    assert out.rollout_infos["total_reward"] == 1.0 and out.rollout_infos["step_rewards"] == [0.0, 0.0, 1.0]
    assert out.rollout_infos["stop_reason"] == "done" and out.rollout_infos["num_turns"] == 3
    obs = [m["content"] for m in out.messages if m["role"] == "user"][1:]
    assert obs == ["8 is too high. Guess lower.", "2 is too low. Guess higher."]
    enc = encode(out, prompt.messages)
    p1, p2, p3 = engine.produced
    g1, g2 = gap_ids(tok, "user", obs[0]), gap_ids(tok, "user", obs[1])
    assert enc.completion_mask == [1] * len(p1) + [0] * len(g1) + [1] * len(p2) + [0] * len(g2) + [1] * len(p3)


def test_gym_env_from_gym_env_option_and_reset_observation():
    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, lambda r: "5")
    sched = GYMScheduler(engine, max_turns=1, tokenizer=tok, gym_env="guess_number")
    sys_only = request("unused", env_config={"secret": 5})
    sys_only.messages = [{"role": "system", "content": "Be brief."}]
    out = run_one(sched, sys_only)
    # no user message in the row: the env's instructions become the prompt (the trainer encodes this request)
    assert sys_only.messages[-1]["content"].startswith("I am thinking of a number between 1 and 16")
    assert out.rollout_infos["total_reward"] == 1.0 and not sched._episodes  # episode closed


class _Boom(Env):
    closed = 0

    async def reset(self, config):
        return "", {}

    async def step(self, action):
        raise ValueError("kaput")

    async def close(self):
        _Boom.closed += 1


def test_gym_env_error_ends_the_trajectory_and_training_continues(caplog):
    envs["boom"] = _Boom
    closed_before = _Boom.closed  # a class-wide count: test_gym_reset_failure's subclass closes too
    try:
        tok = tiny_tokenizer()
        engine = ScriptedEngine(tok, lambda r: "1")
        reqs = [
            request("a", env_config={"name": "boom"}),
            request("b", env_config={"name": "guess_number", "secret": 1}),
        ]
        with caplog.at_level(logging.ERROR):
            outs = run_trajectories(GYMScheduler(engine, max_turns=3, tokenizer=tok), reqs, RequestConfig())
        assert outs[0].rollout_infos["env_error"] == "ValueError: kaput"
        assert outs[0].rollout_infos["total_reward"] == 0.0 and outs[0].rollout_infos["num_turns"] == 1
        assert outs[1].rollout_infos["total_reward"] == 1.0 and "env_error" not in outs[1].rollout_infos
        assert reqs[0].request_id in caplog.text and "kaput" in caplog.text
        assert _Boom.closed == closed_before + 1  # the failed env was closed, once
    finally:
        del envs["boom"]


def test_gym_unknown_env_names():
    from grpokit.config.args import RolloutArguments
    from grpokit.rollout.multi_turn import build_scheduler

    tok = tiny_tokenizer()
    with pytest.raises(ConfigError, match=r"--gym_env 'nope'.*guess_number"):
        build_scheduler(RolloutArguments(multi_turn_scheduler="gym_scheduler", gym_env="nope"), tok)
    sched = GYMScheduler(ScriptedEngine(tok, lambda r: "1"), tokenizer=tok)
    with pytest.raises(ConfigError, match=r"--gym_env 'chess'.*guess_number"):
        run_one(sched, request("x", env_config={"name": "chess"}))
    with pytest.raises(ConfigError, match="no env_config.name and --gym_env is not set"):
        run_one(sched, request("x"))
    with pytest.raises(ConfigError, match="integer 'secret'"):
        GuessNumberEnv({"name": "guess_number"})


def test_gym_reset_failure_is_a_rollout_error():
    class BadReset(_Boom):
        async def reset(self, config):
            raise OSError("no server")

    envs["bad_reset"] = BadReset
    try:
        tok = tiny_tokenizer()
        with pytest.raises(RolloutError, match="env 'bad_reset' reset failed: OSError: no server"):
            run_one(
                GYMScheduler(ScriptedEngine(tok, lambda r: "1"), tokenizer=tok),
                request("x", env_config={"name": "bad_reset"}),
            )
    finally:
        del envs["bad_reset"]
