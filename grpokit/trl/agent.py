"""TRL's ``tools``, ``environment_factory`` and ``rollout_func`` on grpokit's rollout machinery."""

from __future__ import annotations

from typing import Any

from grpokit.errors import ConfigError


def rollout_parts(cfg, tools: Any, environment_factory: Any, rollout_func: Any, args: Any, owner: Any):
    """(scheduler or None, cfg) for the rollout TRL's arguments ask for."""
    for name, value in (("tools", tools), ("environment_factory", environment_factory), ("rollout_func", rollout_func)):
        if value:
            raise ConfigError(f"GRPOTrainer({name}=...): not supported yet")
    return None, cfg
