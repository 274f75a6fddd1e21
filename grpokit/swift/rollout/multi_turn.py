"""``swift.rollout.multi_turn``: scheduler base classes, the built-in schedulers and ``multi_turns``."""

from grpokit.rollout.builtin_schedulers import GYMScheduler  # noqa: F401 (re-exported)
from grpokit.rollout.multi_turn import MultiTurnScheduler, multi_turns  # noqa: F401
from grpokit.rollout.scheduler import RolloutScheduler  # noqa: F401

__all__ = ["GYMScheduler", "MultiTurnScheduler", "RolloutScheduler", "multi_turns"]
