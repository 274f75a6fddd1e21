"""The option rules that need a component's knowledge, registered by the component that has it.

``grpokit.config`` imports no runtime package: a rule that needs one (the names a plugin may add to an algorithm
registry, a chat-template option, a grammar a completion must follow) lives with that component, which adds it
here under one of ``SLOTS`` with ``@option_check(slot)``. ``validate`` runs each slot's rules at its place in its
order of checks, so errors come in the same order as when config called them itself. A component may also
``provide`` a function config calls by name (``load_plugins``: ``--external_plugins`` for ``--help``).

The components that register are named in ``COMPONENTS`` and imported the first time a rule is needed
(``load_components``), as Django's system checks find theirs through ``INSTALLED_APPS``: importing config stays
light (``grpokit train --help`` answers without torch) and no config module imports a runtime one.
``tests/unit/test_config_leaf.py`` keeps ``COMPONENTS`` equal to the modules that register.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# where validate runs each slot's rules: the data options (after CHORD and the teacher), the sampling options
# (after the paths and lengths), the names in registries a plugin may extend (once the plugins have loaded)
SLOTS = ("data", "sampling", "names")

# the modules whose import registers rules or provides functions (in the order they are imported)
COMPONENTS = (
    "grpokit.algorithms",
    "grpokit.engines.option_checks",
    "grpokit.template.prompts",
    "grpokit.plugins.loader",
)

_CHECKS: dict[str, list[Callable[..., Any]]] = {slot: [] for slot in SLOTS}
_PROVIDED: dict[str, Callable[..., Any]] = {}


def option_check(slot: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@option_check("data")``: run ``fn(cfg)`` (a ``TrainConfig``; ConfigError for a bad option) in that slot."""
    if slot not in _CHECKS:
        raise ValueError(f"option check slot {slot!r}: unknown; use one of {', '.join(SLOTS)}")

    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        if fn not in _CHECKS[slot]:  # a module imported twice registers once
            _CHECKS[slot].append(fn)
        return fn

    return add


def run_checks(slot: str, cfg: Any) -> None:
    """Every rule registered in ``slot``, in registration order, on ``cfg``."""
    load_components()
    for fn in _CHECKS[slot]:
        fn(cfg)


def provide(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    _PROVIDED[name] = fn
    return fn


def provided(name: str) -> Callable[..., Any]:
    """The function a component provides under ``name`` (its components imported first)."""
    load_components()
    return _PROVIDED[name]


def load_components() -> None:
    """Import the registering components (once; an import already done costs a dict lookup)."""
    for name in COMPONENTS:
        importlib.import_module(name)
