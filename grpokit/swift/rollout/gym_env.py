"""``swift.rollout.gym_env``: ``Env`` (reset returns observation, info, system_message) and ``envs``."""

from grpokit.rollout.env import Env, envs  # noqa: F401 (re-exported)

__all__ = ["Env", "envs"]
