"""Reward functions (``orms``), process rewards (``prms``), reward-model plugins (``rm_plugins``) and their runner.

Importing this package registers the built-ins: accuracy, format, react_format, cosine, repetition, soft_overlong,
toolbench, math, code_exec, reasoning_gym (in ``orms``) and arithmetic_steps (in ``prms``). See docs/rewards.md.
"""

from __future__ import annotations

# noqa: F401 below: imported to register the built-ins
from grpokit.rewards import code_exec, math_rewards, multimodal, prm, reasoning_gym, shape_rewards, toolbench  # noqa: F401
from grpokit.rewards.base import ORM, PRM, TRAINER_KWARGS, AsyncORM, accepted_kwargs, orms, prms, required_columns
from grpokit.rewards.build import build_reward_funcs, check_reward_columns, reward_name
from grpokit.rewards.calling import TrainerStateView, trl_convention
from grpokit.rewards.rm_plugin import (
    DefaultRMPlugin,
    GenRMPlugin,
    RewardModelReward,
    RMTemplate,
    build_reward_model_reward,
    load_reward_model,
    make_rm_plugin,
    rm_plugins,
)
from grpokit.rewards.runner import RewardRunner, is_async_reward

__all__ = [
    "ORM",
    "PRM",
    "TRAINER_KWARGS",
    "AsyncORM",
    "DefaultRMPlugin",
    "GenRMPlugin",
    "RMTemplate",
    "RewardModelReward",
    "RewardRunner",
    "TrainerStateView",
    "accepted_kwargs",
    "build_reward_funcs",
    "build_reward_model_reward",
    "check_reward_columns",
    "is_async_reward",
    "load_reward_model",
    "make_rm_plugin",
    "orms",
    "prms",
    "required_columns",
    "reward_name",
    "rm_plugins",
    "trl_convention",
]
