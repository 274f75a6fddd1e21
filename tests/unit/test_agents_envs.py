"""The parts of --verifiers_env and OpenEnvScheduler that need neither library: the rubric's reward columns and
weights, the option checks, the OpenEnv observation text. (The libraries' own runs: tests/agents_env.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grpokit.agents.verifiers_env import SCORES_INFO, RubricScore, check_verifiers_options, rubric_columns
from grpokit.config.args import RolloutArguments
from grpokit.errors import ConfigError
from grpokit.rollout.openenv_scheduler import observation_text


def test_rubric_columns_log_each_function_at_weight_zero_before_the_gym_weight():
    fmt = object()
    funcs, names, weights = rubric_columns(["correct", "length"], [fmt], ["format"], None)
    assert names == ["format", "correct", "length"] and funcs[0] is fmt
    assert weights == [1.0, 0.0, 0.0]  # setup_rewards appends gym_reward's 1.0: the rubric's total, counted once
    _, _, weights = rubric_columns(["correct"], [fmt], ["format"], [0.5, 2.0])  # format, gym_reward
    assert weights == [0.5, 0.0, 2.0]
    assert rubric_columns(None, [fmt], ["format"], None) == ([fmt], ["format"], None)
    with pytest.raises(ConfigError, match="--reward_funcs correct"):
        rubric_columns(["correct"], [fmt], ["correct"], None)


def test_a_rubric_column_reads_the_episode_scores_and_none_where_there_is_none():
    column = RubricScore("correct")
    infos = [{SCORES_INFO: {"correct": 1.0, "length": 0.25}}, {SCORES_INFO: {}}, {}]
    assert column(["a", "b", "c"], rollout_infos=infos) == [1.0, None, None]
    assert column.__name__ == "correct"


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"agent": "calc"}, "--agent calc"),
        ({"multi_turn_scheduler": "gym_scheduler"}, "--multi_turn_scheduler gym_scheduler"),
        ({"use_vllm": True}, "--use_vllm true is not implemented"),
    ],
)
def test_verifiers_env_refuses_what_plays_its_own_episodes(extra, match):
    check_verifiers_options(RolloutArguments())  # unset: nothing to check
    with pytest.raises(ConfigError, match=match):
        check_verifiers_options(RolloutArguments(verifiers_env="my_env", **extra))


def test_an_observation_reads_as_its_one_text_field_else_json():
    assert observation_text("plain") == "plain"
    one = SimpleNamespace(model_dump=lambda: {"board": "..x", "done": False, "reward": 1.0, "metadata": {}})
    assert observation_text(one) == "..x"
    two = SimpleNamespace(model_dump=lambda: {"board": "..x", "moves": 3, "done": True, "reward": None})
    assert observation_text(two) == '{"board": "..x", "moves": 3}'
