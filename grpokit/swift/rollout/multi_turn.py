"""``swift.rollout.multi_turn``: scheduler base classes, the built-in schedulers (ms-swift's class names) and
``multi_turns``."""

from grpokit.errors import ConfigError
from grpokit.rollout.builtin_schedulers import GYMScheduler, MathTipsScheduler  # noqa: F401 (re-exported)
from grpokit.rollout.builtin_schedulers import ThinkingTipsScheduler as ThinkingModelTipsScheduler  # noqa: F401
from grpokit.rollout.multi_turn import MultiTurnScheduler, multi_turns  # noqa: F401
from grpokit.rollout.scheduler import RolloutScheduler  # noqa: F401

__all__ = ["GYMScheduler", "MathTipsScheduler", "MultiTurnScheduler", "RolloutScheduler",
           "ThinkingModelTipsScheduler", "multi_turns"]


class OpenEnvScheduler(MultiTurnScheduler):
    """ms-swift's scheduler for OpenEnv environments (its openenv example imports it). grpokit does not drive
    OpenEnv yet: constructing one fails with a line saying what is missing, never a half-working run."""

    def __init__(self, *args, **kwargs) -> None:
        import importlib.util

        if importlib.util.find_spec("openenv") is None:
            raise ConfigError("OpenEnvScheduler needs the openenv package (pip install openenv), and grpokit's "
                              "OpenEnv support, which is not built yet; use --multi_turn_scheduler gym_scheduler "
                              "with a grpokit Env meanwhile")
        raise ConfigError("OpenEnvScheduler: grpokit's OpenEnv support is not built yet (the openenv package is "
                          "installed, but no grpokit scheduler drives it); use --multi_turn_scheduler "
                          "gym_scheduler with a grpokit Env meanwhile")


__all__ += ["OpenEnvScheduler"]
