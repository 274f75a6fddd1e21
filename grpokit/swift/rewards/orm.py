"""``swift.rewards.orm``: the base classes, ``orms`` and the built-in rewards ms-swift's plugins reuse."""

from grpokit.rewards.base import ORM, AsyncORM, orms  # noqa: F401 (re-exported)
from grpokit.rewards.math_rewards import MathAccuracy  # noqa: F401

__all__ = ["ORM", "AsyncORM", "MathAccuracy", "orms"]
