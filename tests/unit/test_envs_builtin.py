"""math_env (rollout/envs_builtin.py): ms-swift's gym environment contract, alone and under gym_scheduler with the
scripted one-token-per-character engine of test_multi_turn.py."""

from __future__ import annotations

import asyncio

import pytest
from test_multi_turn import ScriptedEngine, encode, n_assistant, request, run_one, tiny_tokenizer

from grpokit.errors import DataError
from grpokit.rollout.builtin_schedulers import GYMScheduler
from grpokit.rollout.env import envs
from grpokit.rollout.envs_builtin import MATH_RETRY, MATH_SYSTEM, MathEnv
from grpokit.swift.rollout.gym_env import SimpleMathEnv


def test_math_env_is_registered_under_ms_swifts_name():
    assert envs["math_env"] is MathEnv is SimpleMathEnv


def test_reset_gives_the_problem_and_the_answer_format_and_step_scores_it():
    env = MathEnv({})
    req = request("ignored", problem="What is 2 + 3?", solution="$\\boxed{5}$")
    obs, info, system = asyncio.run(env.reset(req))
    assert (obs, info, system) == ("What is 2 + 3?", {}, MATH_SYSTEM)
    assert "<think>" in system and "<answer>" in system
    wrong = asyncio.run(env.step([{"role": "assistant", "content": "<think>2+3</think><answer>6</answer>"}]))
    assert wrong == (MATH_RETRY, 0.0, False, {"math_reward": 0.0})
    right = asyncio.run(env.step([{"role": "assistant", "content": "<think>2+3</think><answer>5</answer>"}]))
    assert right[1:] == (1.0, True, {"math_reward": 1.0, "stop_reason": "Correct"})


def test_reset_falls_back_to_the_user_message_and_needs_a_solution():
    obs, _, _ = asyncio.run(MathEnv({}).reset(request("What is 1 + 1?", solution="2")))
    assert obs == "What is 1 + 1?"
    with pytest.raises(DataError, match="no 'solution' column.*--vllm_server_pass_dataset true"):
        asyncio.run(MathEnv({}).reset(request("What is 1 + 1?")))


def test_gym_scheduler_runs_math_env_until_the_answer_is_right():
    tok = tiny_tokenizer()
    replies = ["<answer>4</answer>", "<answer>5</answer>", "<answer>5</answer>"]
    engine = ScriptedEngine(tok, lambda r: replies[n_assistant(r)])
    prompt = request("row prompt", problem="What is 2 + 3?", solution="5")
    out = run_one(GYMScheduler(engine, max_turns=5, tokenizer=tok, gym_env="math_env"), prompt)
    # the env's system message and problem replace the row's prompt (ms-swift's replacement)
    assert prompt.messages == [
        {"role": "system", "content": MATH_SYSTEM},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    assert out.rollout_infos["step_rewards"] == [0.0, 1.0] and out.rollout_infos["total_reward"] == 1.0
    assert [m["content"] for m in out.messages if m["role"] == "user"][1:] == [MATH_RETRY]
    p1, p2 = engine.produced
    enc = encode(out, prompt.messages)
    assert enc.completion_mask.count(1) == len(p1) + len(p2)  # the retry turn is not trained on
