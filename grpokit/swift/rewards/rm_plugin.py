"""``swift.rewards.rm_plugin``: reward-model plugins (ms-swift's ``(model, template)`` contract)."""

from grpokit.rewards.rm_plugin import DefaultRMPlugin, GenRMPlugin, RMTemplate, rm_plugins  # noqa: F401

__all__ = ["DefaultRMPlugin", "GenRMPlugin", "RMTemplate", "rm_plugins"]
