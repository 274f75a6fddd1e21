"""Registries are dicts that plugins write into, by decorator or, as in ms-swift, by item assignment.

``Registry`` adds to ``dict``: a decorator, a lookup error that lists the registered names, and two rules for a
name that is taken (as verl's ``register_adv_est``):

- ``register(name)`` refuses a second object under a taken name with one line naming the registry, the name and
  the way to replace it, ``register(name, override=True)``;
- item assignment (``orms["accuracy"] = MyAccuracy``) replaces and logs which entry wins: ms-swift's registries
  are plain dicts, so plugin files ported from it replace built-ins that way and must keep loading.

The same definition registered again (a plugin file or module imported twice: same module, same qualified name)
is not a second object: it replaces the first without a word.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from grpokit.errors import ConfigError, PluginError

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Registry(dict):
    def __init__(self, kind: str, option: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kind = kind  # e.g. "reward function"
        self.option = option  # e.g. "--reward_funcs"

    def __setitem__(self, name: str, value: Any) -> None:
        if self._clashes(name, value):
            logger.warning(
                "%s %r registered again: %s replaces %s", self.kind, name, _describe(value), _describe(self[name])
            )
        super().__setitem__(name, value)

    def register(self, name: str, obj: Any = None, *, override: bool = False) -> Any:
        """``@registry.register("name")`` (or ``registry.register("name", obj)``): add ``obj`` under ``name``.
        A name that holds another object is refused unless ``override=True``."""

        def wrap(value: T) -> T:
            if self._clashes(name, value) and not override:
                raise PluginError(
                    f"{self.kind} registry ({self.option}): {name!r} is already registered as "
                    f"{_describe(self[name])}; to replace it, register with override=True "
                    f"(register({name!r}, override=True))"
                )
            self[name] = value  # an override logs which entry wins, as item assignment does
            return value

        return wrap if obj is None else wrap(obj)

    def override(self, name: str, obj: Any) -> Any:
        """Replace (or add) ``name`` on purpose: ``register(name, obj, override=True)``."""
        return self.register(name, obj, override=True)

    def get_or_raise(self, name: str) -> Any:
        if name not in self:
            known = ", ".join(sorted(self)) or "(none)"
            raise ConfigError(f"{self.option} {name!r}: unknown {self.kind}; registered: {known}")
        return self[name]

    def _clashes(self, name: str, value: Any) -> bool:
        """``name`` holds another object than ``value``, and not a re-import of the same definition."""
        if name not in self:
            return False
        old = dict.__getitem__(self, name)
        return old is not value and not _same_definition(old, value)


def _same_definition(a: Any, b: Any) -> bool:
    """Both objects come from one definition executed twice (a module imported again): same module and name."""
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    names = [(getattr(x, "__module__", None), getattr(x, "__qualname__", None)) for x in (a, b)]
    return names[0] == names[1] and None not in names[0] and not names[0][1].endswith("<lambda>")


def _describe(obj: Any) -> str:
    if isinstance(obj, str):
        return obj
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
