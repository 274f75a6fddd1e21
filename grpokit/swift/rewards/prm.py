"""``swift.rewards.prm``: the process-reward base class and ``prms``."""

from grpokit.rewards.base import PRM, prms  # noqa: F401 (re-exported)

__all__ = ["PRM", "prms"]
