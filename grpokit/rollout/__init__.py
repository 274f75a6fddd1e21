"""Rollouts: the schedulers that drive an engine through single- and multi-turn trajectories, environments, tools.

Importing the package registers the built-in schedulers and environments (``multi_turns``, ``envs``).
"""

from grpokit.rollout import (
    builtin_schedulers,  # noqa: F401 - registers the built-ins
    envs_builtin,  # noqa: F401 - registers math_env
    openenv_scheduler,  # noqa: F401 - registers OpenEnvScheduler (openenv itself is imported by the env's module)
)
