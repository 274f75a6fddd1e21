"""``swift.rollout.multi_turn``: scheduler base classes, the built-in schedulers (ms-swift's class names) and
``multi_turns``."""

from grpokit.rollout.builtin_schedulers import GYMScheduler, MathTipsScheduler  # noqa: F401 (re-exported)
from grpokit.rollout.builtin_schedulers import ThinkingTipsScheduler as ThinkingModelTipsScheduler  # noqa: F401
from grpokit.rollout.multi_turn import MultiTurnScheduler, multi_turns  # noqa: F401
from grpokit.rollout.openenv_scheduler import OpenEnvScheduler  # noqa: F401 - in-process OpenEnv (no server)
from grpokit.rollout.scheduler import RolloutScheduler  # noqa: F401

__all__ = [
    "GYMScheduler",
    "MathTipsScheduler",
    "MultiTurnScheduler",
    "OpenEnvScheduler",
    "RolloutScheduler",
    "ThinkingModelTipsScheduler",
    "multi_turns",
]
