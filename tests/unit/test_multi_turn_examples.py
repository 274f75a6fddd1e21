"""The three customisation examples in examples/multi_turn/ run with the scripted engine, masks checked."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from test_multi_turn import ScriptedEngine, encode, n_assistant, request, run_one, tiny_tokenizer

from grpokit.rollout.builtin_schedulers import GYMScheduler
from grpokit.rollout.env import envs
from grpokit.rollout.multi_turn import multi_turns

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "multi_turn"


@pytest.fixture
def load_example():
    added: list[tuple[dict, str]] = []

    def load(name: str, registry: dict, key: str):
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        added.append((registry, key))
        return module

    yield load
    for registry, key in added:
        registry.pop(key, None)


def test_route1_answer_tag_inserts_masked_prefix_and_continues(load_example):
    mod = load_example("answer_tag_scheduler", multi_turns, "answer_tag")
    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, lambda r: "The sum is 4." if r.messages[-1]["role"] == "user" else "4</answer>")
    out = run_one(multi_turns["answer_tag"](engine, max_turns=2, tokenizer=tok), request("2+2?"), logprobs=True)
    p1, p2 = engine.produced
    inserted = tok(mod.FORCED_PREFIX, add_special_tokens=False)["input_ids"]
    # turn 1 without its trailing eos (13 characters), the forced prefix (mask 0), then turn 2
    assert out.response_token_ids == [p1[:-1] + inserted + p2]
    assert out.response_loss_mask == [[1] * 13 + [0] * len(inserted) + [1] * len(p2)]
    assert out.messages[-1]["content"] == "The sum is 4." + mod.FORCED_PREFIX + "4</answer>"
    assert len(out.rollout_logprobs[0]) == 13 + len(p2)


def test_route2_critic_revise_side_call_is_not_trained(load_example):
    load_example("critic_revise_run", multi_turns, "critic_revise")
    tok = tiny_tokenizer()

    def reply(r):
        if r.messages[0]["content"].startswith("Question:"):
            return "Too short."  # the critic's side conversation
        return "It is 6." if n_assistant(r) == 0 else "6"

    engine = ScriptedEngine(tok, reply)
    prompt = request("What is 2 * 3?")
    out = run_one(multi_turns["critic_revise"](engine, tokenizer=tok), prompt)
    answer, critique, final = engine.produced
    assert out.rollout_infos["critique"] == "Too short."
    assert out.response_token_ids == [answer, final]  # the critique's tokens are in no segment
    enc = encode(out, prompt.messages)
    gap = tok(
        "\n<|im_start|>user\nA reviewer says: Too short.\nGive your final answer.<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )["input_ids"]
    assert enc.completion_ids == answer + gap + final
    assert enc.completion_mask == [1] * len(answer) + [0] * len(gap) + [1] * len(final)


def test_route3_reach_target_env_with_gym_scheduler(load_example):
    load_example("reach_target_env", envs, "reach_target")
    tok = tiny_tokenizer()
    replies = ["3", "then 1"]
    engine = ScriptedEngine(tok, lambda r: replies[n_assistant(r)])
    prompt = request("Count with me.", env_config={"name": "reach_target", "target": 4})
    out = run_one(GYMScheduler(engine, max_turns=6, tokenizer=tok), prompt)
    # ms-swift's rule: the env's observation replaces the row's prompt
    assert [m["role"] for m in prompt.messages] == ["user"]
    assert prompt.messages[0]["content"].startswith("We start at 0 and must reach exactly 4")
    assert out.rollout_infos["step_rewards"] == [0.0, 1.0] and out.rollout_infos["total_reward"] == 1.0
    assert out.messages[2] == {"role": "user", "content": "The total is 3. Add 1, 2 or 3."}
