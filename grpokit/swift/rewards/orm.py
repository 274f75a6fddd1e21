"""``swift.rewards.orm``: the base classes, ``orms`` and the built-in rewards ms-swift's plugins reuse (same class
names as ms-swift's; grpokit's implementations, registered under the same ``--reward_funcs`` names)."""

from grpokit.rewards.base import ORM, AsyncORM, orms  # noqa: F401 (re-exported)
from grpokit.rewards.math_rewards import MathAccuracy, MathORM  # noqa: F401
from grpokit.rewards.shape_rewards import CosineReward, Format, ReActFormat, RepetitionPenalty, SoftOverlong  # noqa
from grpokit.rewards.toolbench import ReactORM  # noqa: F401

__all__ = [
    "ORM",
    "AsyncORM",
    "CosineReward",
    "Format",
    "MathAccuracy",
    "MathORM",
    "ReActFormat",
    "ReactORM",
    "RepetitionPenalty",
    "SoftOverlong",
    "orms",
]
