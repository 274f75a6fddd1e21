"""Turn ``--reward_funcs`` names into callables, and check them against the dataset's columns before training.

Construction follows ms-swift: a registered class is instantiated once with the keyword arguments its
``__init__`` names, each picked by name from the flat dict of all options (``cosine_max_len``,
``code_exec_timeout``, …), plus ``tokenizer`` when it names one and ``args`` (a namespace of all options, for
code ported from ms-swift). Registered functions and instances, and non-string entries, are used as they are.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

from grpokit.data import CONVERSATIONAL_COLUMN
from grpokit.errors import ConfigError
from grpokit.rewards.base import TRAINER_KWARGS, orms, prms, required_columns
from grpokit.rewards.calling import check_signature


def reward_name(func: Any) -> str:
    """A display name for a reward callable given directly (not by registered name)."""
    if isinstance(func, str):
        return func
    return getattr(func, "__name__", None) or type(func).__name__


def _lookup(name: str) -> Any:
    if name in orms:
        return orms[name]
    if name in prms:
        return prms[name]
    known = ", ".join(sorted(set(orms) | set(prms))) or "(none)"
    raise ConfigError(
        f"--reward_funcs {name!r}: unknown reward function; registered: {known} "
        "(a plugin file given with --external_plugins can register more)"
    )


def instantiate(cls: type, name: str, options: dict[str, Any], tokenizer: Any = None) -> Any:
    """Instantiate a reward class with the constructor arguments it names, taken from options by name."""
    params = list(inspect.signature(cls).parameters.values())
    kwargs: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name == "tokenizer":
            kwargs["tokenizer"] = tokenizer
        elif p.name == "args":
            kwargs["args"] = SimpleNamespace(**options)
        elif p.name in options:
            kwargs[p.name] = options[p.name]
        elif p.default is p.empty:
            raise ConfigError(f"--reward_funcs {name}: needs option --{p.name}, which is not set")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"--reward_funcs {name}: could not be built: {type(exc).__name__}: {exc}") from exc


def build_reward_funcs(names: list[Any], options: dict[str, Any] | None = None, tokenizer: Any = None) -> list[Any]:
    """One callable per entry of ``names``: registered names are looked up and classes instantiated."""
    options = dict(options or {})
    funcs = []
    for entry in names:
        if not isinstance(entry, str):
            obj, name = entry, reward_name(entry)
        else:
            obj, name = _lookup(entry), entry
        funcs.append(instantiate(obj, name, options, tokenizer) if inspect.isclass(obj) else obj)
    return funcs


def check_reward_columns(funcs: list[Any], names: list[str], available: set[str]) -> None:
    """Raise ConfigError when a reward's signature fits no calling convention (``calling.check_signature``) or
    when it needs a column that neither the dataset nor the trainer supplies."""
    if len(funcs) != len(names):
        raise ConfigError(f"check_reward_columns: {len(funcs)} reward functions but {len(names)} names")
    available = set(available) - {CONVERSATIONAL_COLUMN}  # hidden: no reward reads it as a column
    have = set(available) | TRAINER_KWARGS
    for func, name in zip(funcs, names):
        check_signature(func, name)
        missing = required_columns(func) - have
        if missing:
            cols = ", ".join(sorted(available)) or "(none)"
            raise ConfigError(
                f"--reward_funcs {name}: needs dataset column(s) {', '.join(sorted(missing))}, "
                f"which the dataset lacks; dataset columns: {cols}. Add the column or choose another reward"
            )
