"""``swift.rollout``: multi-turn schedulers and gym environments."""

from grpokit.rollout.env import Env, envs  # noqa: F401 (re-exported)
from grpokit.rollout.multi_turn import MultiTurnScheduler, multi_turns  # noqa: F401
from grpokit.rollout.scheduler import RolloutScheduler  # noqa: F401

__all__ = ["Env", "MultiTurnScheduler", "RolloutScheduler", "envs", "multi_turns"]
