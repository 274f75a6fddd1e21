"""Registries are plain dicts that plugins write into (``orms['my_reward'] = MyReward``).

``Registry`` adds three things to ``dict``: a decorator, a warning that says which entry wins when a name is
registered twice, and a lookup error that lists the registered names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from grpokit.errors import ConfigError

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Registry(dict):
    def __init__(self, kind: str, option: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kind = kind  # e.g. "reward function"
        self.option = option  # e.g. "--reward_funcs"

    def __setitem__(self, name: str, value: Any) -> None:
        if name in self and self[name] is not value:
            logger.warning(
                "%s %r registered again: %s replaces %s", self.kind, name, _describe(value), _describe(self[name])
            )
        super().__setitem__(name, value)

    def register(self, name: str) -> Callable[[T], T]:
        def wrap(obj: T) -> T:
            self[name] = obj
            return obj

        return wrap

    def get_or_raise(self, name: str) -> Any:
        if name not in self:
            known = ", ".join(sorted(self)) or "(none)"
            raise ConfigError(f"{self.option} {name!r}: unknown {self.kind}; registered: {known}")
        return self[name]


def _describe(obj: Any) -> str:
    if isinstance(obj, str):
        return obj
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
