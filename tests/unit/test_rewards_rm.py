"""Reward models: the default seq-cls plugin on a tiny model, a generative judge behind a fake engine."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.errors import ConfigError
from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RequestConfig
from grpokit.rewards import (
    DefaultRMPlugin,
    GenRMPlugin,
    RewardModelReward,
    RewardRunner,
    build_reward_model_reward,
    load_reward_model,
    rm_plugins,
)
from grpokit.rewards.rm_plugin import parse_judge_score, with_completion

PROMPT = [{"role": "user", "content": "What is 7 + 5?"}]


def test_load_reward_model_is_frozen(tiny_rm):
    _, model, tokenizer = tiny_rm
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert model.config.pad_token_id == tokenizer.pad_token_id


def test_load_reward_model_missing_path():
    with pytest.raises(ConfigError, match=r"--reward_model \./no/such/rm: not found"):
        load_reward_model("./no/such/rm")


def test_default_plugin_batched_equals_one_by_one(tiny_rm):
    _, model, tokenizer = tiny_rm
    plugin = DefaultRMPlugin(model, tokenizer, batch_size=4)
    # different lengths, so the batch really is padded; 5 conversations with batch_size 4 -> two batches
    conversations = [PROMPT + [{"role": "assistant", "content": "12 " * k}] for k in range(1, 6)]
    batched = plugin(conversations)
    single = [plugin([c])[0] for c in conversations]
    assert len(batched) == 5 and all(math.isfinite(s) for s in batched)
    assert torch.allclose(torch.tensor(batched), torch.tensor(single), atol=1e-5)
    assert len(set(round(s, 6) for s in batched)) > 1  # the scores depend on the text


def test_reward_model_reward_in_runner(tiny_rm):
    path, model, tokenizer = tiny_rm
    reward = build_reward_model_reward(str(path), name="rm")
    assert isinstance(reward.plugin, DefaultRMPlugin)
    # the completion is appended as the last assistant message unless the conversation already ends with one
    full = PROMPT + [{"role": "assistant", "content": "13"}]
    scores = RewardRunner([reward], ["rm"]).compute(["12", "13"], {"messages": [PROMPT, full]})
    direct = DefaultRMPlugin(model, tokenizer)([PROMPT + [{"role": "assistant", "content": "12"}], full])
    assert scores[:, 0].tolist() == pytest.approx(direct, abs=1e-5)
    assert with_completion(full, "ignored") == full


class FakeJudge:
    """An engine that answers each request with the next canned reply (n choices per request)."""

    def __init__(self, replies: list[list[str]]) -> None:
        self.replies = replies
        self.seen = []

    def infer(self, requests, config: RequestConfig):
        self.seen.extend(requests)
        return [
            ChatCompletionResponse(
                choices=[
                    ChatCompletionResponseChoice(
                        index=k, message={"role": "assistant", "content": text}, finish_reason="stop", token_ids=[]
                    )
                    for k, text in enumerate(self.replies[i])
                ]
            )
            for i, _ in enumerate(requests)
        ]


def test_genrm_parses_scores():
    engine = FakeJudge(
        [
            ["Correct and complete. <score>0.9</score>"],
            ["Partly right. Score: 7/10"],
            ["Reward: 0.2", "no number here"],  # two samples: the unparsable one is skipped -> 0.2
        ]
    )
    reward = RewardModelReward(GenRMPlugin(engine), "judge")
    scores = reward(["12", "11", "10"], messages=[PROMPT] * 3)
    assert scores == pytest.approx([0.9, 0.7, 0.2])
    judge_prompt = engine.seen[0].messages[-1]["content"]
    assert "User: What is 7 + 5?" in judge_prompt and "Assistant: 12" in judge_prompt


def test_genrm_unparsable_reply_scores_zero_with_a_warning_and_a_counter(caplog):
    """ms-swift's rule: no score in the judge's reply -> 0, with a warning; grpokit counts them in last_metrics."""
    plugin = GenRMPlugin(FakeJudge([["<score>1</score>"], ["I think it is fine."]]))
    reward = RewardModelReward(plugin, "judge")
    with caplog.at_level("WARNING", logger="grpokit.rewards.rm_plugin"):
        scores = RewardRunner([reward], ["judge"]).compute(["12", "13"], {"messages": [PROMPT, PROMPT]})
    assert scores[:, 0].tolist() == [1.0, 0.0]
    assert "genrm: no score in the judge's reply for sample 1" in caplog.text
    assert reward.last_metrics == {"unscored": 1} and plugin.unscored == 1
    reward(["12", "13"], messages=[PROMPT, PROMPT])
    assert plugin.unscored == 2  # the counter runs over the whole training; last_metrics is per call


def test_genrm_needs_an_engine_and_parse_helper():
    with pytest.raises(ConfigError, match="infer"):
        GenRMPlugin(object())
    assert parse_judge_score("score = 3 / 4") == 0.75
    assert parse_judge_score("<SCORE> 1 </SCORE> then Score: 0.5") == 1.0  # the tag wins
    assert parse_judge_score("nothing") is None
    assert set(rm_plugins) >= {"default", "genrm"}
