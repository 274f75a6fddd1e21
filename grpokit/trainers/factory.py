"""Trainer name → importable class path. A plugin may point an entry at its own GRPOTrainer subclass."""

from __future__ import annotations

import importlib

from grpokit.errors import ConfigError


class TrainerFactory:
    TRAINER_MAPPING: dict[str, str] = {"grpo": "grpokit.trainers.grpo_trainer.GRPOTrainer"}

    @classmethod
    def get_trainer_cls(cls, name: str = "grpo"):
        path = cls.TRAINER_MAPPING.get(name)
        if path is None:
            raise ConfigError(f"trainer {name!r} is not registered; known: {', '.join(sorted(cls.TRAINER_MAPPING))}")
        if not isinstance(path, str):  # a class registered directly
            return path
        module, _, attr = path.rpartition(".")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"TRAINER_MAPPING[{name!r}] = {path!r} cannot be imported: {e}") from e
