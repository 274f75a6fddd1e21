"""The one check of every option against its own field: the value's type, its range and its choices.

Each field of ``args.py`` carries what it accepts in its metadata (``_opt(8, "...", ge=1)``): ``bounds`` (a
``Bounds``), ``choices`` (argparse enforces them on flags; this module on values from YAML or code) and
``json_object`` (a str option that YAML may give as a mapping). ``check_fields`` reads them for every option of a
``TrainConfig``, however the value got there (flag, ``--config`` YAML, code); ``coerce_yaml`` turns a YAML value
into the field's type first (a scalar for a list is wrapped, a string is read as a flag's text would be), so every
problem is one line naming the option, the value and what to write instead. Rules between options live in
``validate.py``, not here.

Every number is bounded: a float must be finite and within its field's bounds; an int without an upper bound of
its own is at most ``INT_LIMIT`` (what 32-bit counters and C ``int`` arguments downstream can hold). Torch-free:
``--help`` builds on it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from types import NoneType, UnionType
from typing import Any, Literal

from grpokit.errors import ConfigError

INT_LIMIT = 2**31 - 1
SHOWN_CHARS = 80  # at most this much of a bad value is repeated in its error line
# metadata keys of ours: the argument parser must not pass them to argparse
BOUNDS, JSON_OBJECT = "bounds", "json_object"
OWN_KEYS = (BOUNDS, JSON_OBJECT)


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclass(frozen=True)
class Bounds:
    """A numeric range: ``ge``/``gt`` below, ``le``/``lt`` above (None: open); ``also`` lists values outside it that
    keep a documented meaning (``top_k -1``: off); ``why`` is said in the error."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    also: tuple = ()
    why: str = ""

    def holds(self, value) -> bool:
        if value in self.also:
            return True
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def describe(self) -> str:
        low = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None
        high = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None
        if low and high:
            text = f"in {low}, {high}"
        elif low:
            text = f"≥ {_num(self.ge)}" if self.ge is not None else f"> {_num(self.gt)}"
        elif high:
            text = f"≤ {_num(self.le)}" if self.le is not None else f"< {_num(self.lt)}"
        else:
            text = "a finite number"
        if self.also:
            text = f"{' or '.join(map(_num, self.also))}, or {text}"
        return text


def _fix(field: dataclasses.Field) -> str:
    """'; the default is X' when the field has a default value to fall back on."""
    default = field.default
    if default is dataclasses.MISSING or default is None or isinstance(default, bool):
        return ""
    return f"; the default is {_num(default)}"


@dataclass(frozen=True)
class Kind:
    """A field's type taken apart: the base type (or a Literal's values), list or not, None allowed or not."""

    base: Any
    is_list: bool
    optional: bool
    literal: tuple | None


def kind_of(hint) -> Kind:
    optional = False
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, UnionType):
        optional = NoneType in args
        rest = [a for a in args if a is not NoneType]
        if len(rest) != 1:
            raise TypeError(f"option type {hint}: one type (or None) only")
        hint = rest[0]
    is_list = typing.get_origin(hint) is list
    if is_list:
        hint = typing.get_args(hint)[0]
    literal = typing.get_args(hint) if typing.get_origin(hint) is Literal else None
    return Kind(str if literal else hint, is_list, optional, literal)


@functools.cache
def _group_fields(group: type) -> dict[str, tuple[dataclasses.Field, Kind]]:
    """A dataclass's options with their kinds, from its annotations (not ``Field.type``, which the argument parser
    rewrites in place)."""
    hints = typing.get_type_hints(group)
    return {f.name: (f, kind_of(hints[f.name])) for f in dataclasses.fields(group)}


def option_fields(groups) -> dict[str, tuple[dataclasses.Field, Kind]]:
    """Every option of the given dataclasses: name -> (field, its kind)."""
    return {name: fk for g in groups for name, fk in _group_fields(g).items()}


def _show(value) -> str:
    if isinstance(value, list):
        return " ".join(_show(v) for v in value) if value else "[]"
    text = repr(value) if isinstance(value, str) and (not value or any(c.isspace() for c in value)) else str(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 1] + "…"  # an error stays one short line


def _type_word(kind: Kind) -> str:
    if kind.literal:
        return "one of " + ", ".join(map(str, kind.literal))
    return {bool: "true or false", int: "a whole number", float: "a number", str: "text"}.get(kind.base, "a value")


def _is_type(item, base, field: dataclasses.Field) -> bool:
    if base is bool:
        return isinstance(item, bool)
    if base in (int, float) and isinstance(item, bool):  # True is an int to Python, not a number to a user
        return False
    if base is int:
        return isinstance(item, int)
    if base is float:
        return isinstance(item, (int, float))
    return isinstance(item, str) or (isinstance(item, dict) and field.metadata.get(JSON_OBJECT, False))


def _check_item(name: str, kind: Kind, field: dataclasses.Field, item, shown: str) -> None:
    base = kind.base
    if not _is_type(item, base, field):
        raise ConfigError(f"--{name} {shown}: expected {_type_word(kind)}, got {type(item).__name__}")
    if kind.literal and item not in kind.literal:
        raise ConfigError(f"--{name} {shown}: unknown value; use one of {', '.join(map(str, kind.literal))}")
    choices = field.metadata.get("choices")
    if choices and item not in choices:
        raise ConfigError(f"--{name} {shown}: unknown value; use one of {', '.join(map(str, choices))}")
    if base in (int, float):
        b = field.metadata.get(BOUNDS)
        if isinstance(item, float) and not math.isfinite(item):
            want = f" {b.describe()}" if b is not None else ""
            raise ConfigError(f"--{name} {shown}: must be a finite number{want}{_fix(field)}")
        if b is not None and not b.holds(item):
            why = f" ({b.why})" if b.why else ""
            raise ConfigError(f"--{name} {shown}: must be {b.describe()}{why}{_fix(field)}")
        if base is int and abs(item) > INT_LIMIT and (b is None or (b.le is None and b.lt is None)):
            raise ConfigError(
                f"--{name} {shown}: must be at most {INT_LIMIT} in size (the largest count grpokit takes){_fix(field)}"
            )


def check_value(name: str, field: dataclasses.Field, kind: Kind, value) -> None:
    """Raise ConfigError (one line: option, value, what it must be) unless ``value`` fits the field."""
    shown = _show(value)
    if value is None:
        if not kind.optional:
            raise ConfigError(f"--{name}: needs a value ({_type_word(kind)})")
        return
    if kind.is_list:
        if not isinstance(value, list):
            raise ConfigError(f"--{name} {shown}: expected a list of {_type_word(kind)}")
        for item in value:
            _check_item(name, kind, field, item, _show(item) if len(value) > 1 else shown)
        return
    _check_item(name, kind, field, value, shown)


def check_fields(cfg) -> None:
    """Every option of ``cfg`` (a TrainConfig) against its field: type, finiteness, bounds, choices."""
    for part in (cfg.model, cfg.data, cfg.rollout, cfg.algorithm, cfg.reward, cfg.training, cfg.teacher):
        for name, (field, kind) in _group_fields(type(part)).items():
            check_value(name, field, kind, getattr(part, name))


# ---- YAML values into the field's type ------------------------------------------------------------------------
_TRUE, _FALSE = ("true", "yes", "y", "1", "t"), ("false", "no", "n", "0", "f")


def _from_text(name: str, kind: Kind, text: str, where: str):
    """A YAML string read as the same text on the command line would be (``1e-5`` is a string to YAML 1.1)."""
    base = kind.base
    try:
        if base is bool:
            low = text.strip().lower()
            if low in _TRUE + _FALSE:
                return low in _TRUE
            raise ValueError
        if base is int:
            return int(text)
        if base is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{where}{name}: {text!r} is not {_type_word(kind)}") from None
    return text


def _coerce_item(name: str, kind: Kind, field: dataclasses.Field, item, where: str):
    base = kind.base
    if isinstance(item, str) and base is not str:
        return _from_text(name, kind, item, where)
    if base is int and isinstance(item, float) and not isinstance(item, bool):
        if not item.is_integer():
            raise ConfigError(
                f"{where}{name}: {item:g} is not a whole number; write an integer such as "
                f"{math.floor(item) if math.isfinite(item) else 1}"
            )
        return int(item)
    if base is float and isinstance(item, int) and not isinstance(item, bool):
        return float(item)
    if base is str and isinstance(item, (int, float)) and not isinstance(item, bool):
        return str(item)  # `output_dir: 2024`, `system: 42`: the text as written
    if base is str and isinstance(item, dict) and field.metadata.get(JSON_OBJECT, False):
        return item
    check_value(name, field, dataclasses.replace(kind, is_list=False, optional=False), item)
    return item


def coerce_yaml(data: dict, fields: dict[str, tuple[dataclasses.Field, Kind]], where: str) -> dict:
    """The ``--config`` file's values in their fields' types; options that are not fields (ms-swift's names that
    grpokit warns about or refuses) pass as they are. ``where``: ``"--config FILE: "`` for the messages."""
    out = {}
    for name, value in data.items():
        if name not in fields:
            out[name] = value
            continue
        field, kind = fields[name]
        if value is None:
            if not kind.optional and not kind.is_list:
                raise ConfigError(
                    f"{where}{name}: needs a value ({_type_word(kind)}); remove the line to keep the default"
                )
            out[name] = [] if kind.is_list else None
        elif kind.is_list:
            items = value if isinstance(value, list) else [value]  # `reward_funcs: accuracy` is one name
            out[name] = [_coerce_item(name, kind, field, v, where) for v in items]
        elif isinstance(value, list):
            raise ConfigError(f"{where}{name}: expected one value ({_type_word(kind)}), got a list")
        else:
            out[name] = _coerce_item(name, kind, field, value, where)
    return out


def opt(
    default,
    help: str,
    ge=None,
    gt=None,
    le=None,
    lt=None,
    also=(),
    why="",  # noqa: A002 - argparse's
    json_object=False,
    **kw,
):
    """A field with its help text and what it accepts (``grpokit.config.fields`` checks every value against it):
    a numeric range (``ge``/``gt``/``le``/``lt``, ``also`` for documented values outside it, ``why`` said in the
    error), ``choices``, or ``json_object`` for a text option that YAML may give as a mapping."""
    metadata = {"help": help, **kw}
    if any(b is not None for b in (ge, gt, le, lt)) or also:
        metadata[BOUNDS] = Bounds(ge=ge, gt=gt, le=le, lt=lt, also=tuple(also), why=why)
    if json_object:
        metadata[JSON_OBJECT] = True
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda d=default: list(d), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
