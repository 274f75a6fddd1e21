"""``swift.rewards``: reward base classes and the registries ``--reward_funcs``/``--reward_model_plugin`` use."""

from grpokit.rewards import ORM, PRM, AsyncORM, orms, prms, rm_plugins  # noqa: F401 (re-exported)

__all__ = ["ORM", "PRM", "AsyncORM", "orms", "prms", "rm_plugins"]
