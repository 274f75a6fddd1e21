"""Turn ``--reward_funcs`` names into callables, and check them against the dataset's columns before training.

Construction follows ms-swift: a registered class is instantiated once with the keyword arguments its
``__init__`` names, each picked by name from the flat dict of all options (``cosine_max_len``,
``code_exec_timeout``, …), plus ``tokenizer`` when it names one and ``args`` (a namespace of all options, for
code ported from ms-swift). Registered functions and instances, and non-string entries, are used as they are.

A name that is not registered but has a dot is read as TRL's CLI reads ``--reward_funcs``: an import path
``module.function`` (the current directory is searched first). Such a function is called with TRL's convention
(``calling.trl_convention``), as TRL would call it, so a TRL reward file needs no registration code.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from types import SimpleNamespace
from typing import Any

from grpokit.data import CONVERSATIONAL_COLUMN
from grpokit.errors import ConfigError
from grpokit.rewards.base import TRAINER_KWARGS, orms, prms, required_columns
from grpokit.rewards.calling import check_signature, is_marked, trl_convention


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
    module_name, _, attr = name.rpartition(".")
    if module_name and attr:
        return _import_trl_reward(name, module_name, attr)
    raise _unknown(name)


def reward_entry(name: str) -> Any:
    """What the --reward_funcs name ``name`` names (registered, or importable); ConfigError naming it otherwise."""
    return _lookup(name)


def _unknown(name: str, why: str = "") -> ConfigError:
    known = ", ".join(sorted(set(orms) | set(prms))) or "(none)"
    return ConfigError(
        f"--reward_funcs {name!r}: unknown reward function{why}; registered: {known} (a plugin file given with "
        "--external_plugins can register more, or name a function by import path, module.function, as TRL does)"
    )


def _import_trl_reward(name: str, module_name: str, attr: str) -> Any:
    """TRL's ``--reward_funcs my_module.my_reward``: the function, marked to be called the TRL way."""
    if os.getcwd() not in sys.path:  # TRL's scripts import reward modules from where they are started
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise _unknown(name, f" (and no module {e.name!r} to import it from)") from None
        raise ConfigError(f"--reward_funcs {name}: importing {module_name} failed: {type(e).__name__}: {e}") from e
    except Exception as e:  # the user's module ran and raised: say where
        raise ConfigError(f"--reward_funcs {name}: importing {module_name} failed: {type(e).__name__}: {e}") from e
    func = getattr(module, attr, None)
    if func is None or inspect.isclass(func) or not callable(func):
        found = "a class" if inspect.isclass(func) else "nothing" if func is None else type(func).__name__
        raise ConfigError(
            f"--reward_funcs {name}: {module_name}.{attr} is {found}; an import path must name a "
            "reward function (register classes in orms from an --external_plugins file)"
        )
    return func if is_marked(func) else trl_convention(func)


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
