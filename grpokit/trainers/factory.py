"""Trainer name → importable class path. A plugin may point an entry at its own GRPOTrainer subclass.

In a file given with ``--external_plugins my_plugin.py`` (imported as the module ``my_plugin``)::

    TrainerFactory.TRAINER_MAPPING["grpo"] = "my_plugin.MyTrainer"

A class object is accepted too (handy in tests); a string path is what survives into another process.
"""

from __future__ import annotations

import importlib

from grpokit.errors import ConfigError


class TrainerFactory:
    TRAINER_MAPPING: dict[str, str | type] = {"grpo": "grpokit.trainers.grpo_trainer.GRPOTrainer"}

    @classmethod
    def get_trainer_cls(cls, name: str = "grpo") -> type:
        """The class registered under ``name``, imported from its ``module.Class`` path when it is a string."""
        path = cls.TRAINER_MAPPING.get(name)
        if path is None:
            raise ConfigError(f"trainer {name!r} is not registered; known: {', '.join(sorted(cls.TRAINER_MAPPING))}")
        if not isinstance(path, str):  # a class registered directly
            return path
        module, _, attr = path.rpartition(".")
        if not module or not attr:
            raise ConfigError(
                f"TRAINER_MAPPING[{name!r}] = {path!r}: give an importable 'module.Class' path, "
                "e.g. 'my_plugin.MyTrainer' for a class in my_plugin.py"
            )
        try:
            found = getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as e:
            raise ConfigError(
                f"TRAINER_MAPPING[{name!r}] = {path!r} cannot be imported: {e} (load the file that "
                "defines it with --external_plugins)"
            ) from e
        except AttributeError as e:
            raise ConfigError(f"TRAINER_MAPPING[{name!r}] = {path!r} cannot be imported: {e}") from e
        except Exception as e:  # noqa: BLE001 - the module itself failed while importing
            first = str(e).strip().splitlines()[0] if str(e).strip() else "(no message)"
            raise ConfigError(
                f"TRAINER_MAPPING[{name!r}] = {path!r}: importing {module} failed: {type(e).__name__}: {first}"
            ) from e
        if not isinstance(found, type):
            raise ConfigError(f"TRAINER_MAPPING[{name!r}] = {path!r} is a {type(found).__name__}, not a class")
        return found
