"""``swift.rollout.gym_env``: ``Env`` (reset returns observation, info, system_message), ``envs`` and the built-in
``math_env`` under ms-swift's class name ``SimpleMathEnv``."""

from grpokit.rollout.env import Env, envs  # noqa: F401 (re-exported)
from grpokit.rollout.envs_builtin import MathEnv as SimpleMathEnv  # noqa: F401 (re-exported)

__all__ = ["Env", "SimpleMathEnv", "envs"]
