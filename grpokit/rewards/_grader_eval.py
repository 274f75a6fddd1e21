"""The parent-side expression walker of ``grader.py``: it evaluates the tests' expressions in the trainer, on exact
builtin values, and asks the sandbox only for what belongs to the program.

A name the tests do not define is the program's: it evaluates to a ``Remote`` (a name, or a result the sandbox
keeps because it is no plain value). Calling a ``Remote``, or reading an attribute or an item of it, is one call
into the sandbox (``query``); the answer comes back as tagged JSON and is decoded here into fresh builtin objects
(or into another ``Remote``). A ``Remote`` itself never takes part in a comparison, a truth test or arithmetic:
that fails the check, so an object with an ``__eq__`` that always answers True, or a rebound builtin, never
reaches a verdict. Everything computed here is bounded: sizes of sequences and integers, string formatting
widths, iterations (``Budget``), and the sample's deadline.
"""

from __future__ import annotations

import ast
import builtins
import collections
import math
import operator
import re
import time
from typing import Any

from grpokit.rewards import _grader_numpy as _numpy

_SAFE_BUILTINS = {n: getattr(builtins, n) for n in (
    "abs all any bin bool bytes callable chr complex dict divmod enumerate filter float format frozenset hash hex "
    "int isinstance issubclass iter len list map max min next oct ord pow range repr reversed round set sorted str "
    "sum tuple type zip").split()}  # fmt: skip
_SAFE_BUILTINS["print"] = lambda *args, **kwargs: None  # tests that print: nothing to show, nothing to decide
# builtins the tests may not use: evaluated in the trainer they would reach past the grader's bounds (eval, open,
# getattr with dunder names …), and taken for the program's they would put the program's word on the expected side
UNSAFE_BUILTINS = {n for n in dir(builtins) if not n.startswith("_")} - set(_SAFE_BUILTINS) - {
    n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)} - {
    "True", "False", "None", "Ellipsis", "NotImplemented"}  # fmt: skip
_MATH = {n: getattr(math, n) for n in (
    "isclose sqrt floor ceil fabs isnan isinf isfinite inf nan pi e tau log log2 log10 exp sin cos tan atan2 "
    "hypot gcd lcm trunc fsum copysign prod factorial comb perm isqrt").split()}  # fmt: skip
_METHODS = set(
    "strip lstrip rstrip lower upper title capitalize split rsplit splitlines startswith endswith count index find "
    "rfind replace join isdigit isalpha isalnum isspace isupper islower keys values items get real imag append "
    "extend insert pop remove sort reverse copy add update discard union intersection difference issubset "
    "issuperset symmetric_difference most_common elements setdefault".split())  # fmt: skip
_PLAIN = (bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset, type(None), collections.Counter)
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.LShift: operator.lshift, ast.RShift: operator.rshift, ast.BitOr: operator.or_,
           ast.BitAnd: operator.and_, ast.BitXor: operator.xor}  # fmt: skip
_UNOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_, ast.Invert: operator.invert}
_CMPOPS = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
           ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
           ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}  # fmt: skip
MAX_SIZE = 1_000_000  # elements (or characters) a value computed here may have
MAX_INT_BITS = 1 << 22  # bits an integer computed or decoded here may have
MAX_WIDTH = 10_000  # a formatting width or precision
MAX_OPS = 2_000_000  # expression nodes and statements evaluated per sample
MAX_DECODED = 1_000_000  # values decoded from one sample's answers (each a few dozen bytes in the trainer)
_WIDTH_RE = re.compile(r"(\d+|\*)")


class _Fail(Exception):
    """This check cannot pass (a missing or undecodable value, a guard, a program object in a comparison)."""


class CandidateError(Exception):
    """The program raised ``name`` while answering a call (``mro``: the names of its classes, as it says)."""

    def __init__(self, name: str, mro: list[str]) -> None:
        super().__init__(name)
        self.name, self.mro = name, mro


class Remote:
    """A value that lives in the sandbox: a name of the program, or a result kept there (``__R[n]``)."""

    __slots__ = ("src",)

    def __init__(self, src: str) -> None:
        self.src = src

    def __repr__(self) -> str:
        return f"Remote({self.src})"


class Module:
    """A module the tests import, reduced to the names the parent evaluates itself."""

    def __init__(self, name: str, names: dict[str, Any]) -> None:
        self.name, self.names = name, names


class Approx:
    """``pytest.approx``: equal to numbers (or lists/tuples/dicts of them) within a tolerance."""

    def __init__(self, expected: Any, rel: float | None = None, abs: float | None = None) -> None:  # noqa: A002
        self.expected, self.rel, self.abs = expected, 1e-6 if rel is None else rel, 1e-12 if abs is None else abs

    def _close(self, a: Any, b: Any) -> bool:
        if type(a) in (list, tuple) and type(b) in (list, tuple):
            return len(a) == len(b) and all(self._close(x, y) for x, y in zip(a, b))
        if type(a) is dict and type(b) is dict:
            return a.keys() == b.keys() and all(self._close(a[k], b[k]) for k in a)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            return a == b or math.isclose(a, b, rel_tol=self.rel, abs_tol=self.abs)
        return type(a) is type(b) and a == b

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, (Remote, Approx)):
            raise _Fail("approx compared with a program object")
        return self._close(other, self.expected)

    __hash__ = None  # type: ignore[assignment]


class _NoArray:
    """numpy.ndarray and the numpy dtypes: no plain value is one."""


MODULES = {
    "math": _MATH,
    "collections": {"Counter": collections.Counter},
    "numpy": {
        "allclose": _numpy.allclose,
        "isclose": _numpy.isclose,
        "ndarray": _NoArray,
        "float64": _NoArray,
        "float32": _NoArray,
        "inf": math.inf,
        "nan": math.nan,
        "pi": math.pi,
    },  # fmt: skip
    "typing": {},
}


def count_values(obj: Any, limit: int) -> int:
    """How many JSON values ``obj`` holds (ValueError past ``limit``): what decoding it will keep in memory."""
    n, stack = 0, [obj]
    while stack:
        o = stack.pop()
        n += 1
        if n > limit:
            raise ValueError(f"more than {limit} values")
        if type(o) is list:
            stack.extend(o)
        elif type(o) is dict:
            stack.extend(o.values())
    return n


def spread_hashes(items: Any) -> Any:
    """``items`` (a list or tuple), refused when many of them share a hash: a set or dict of them would take
    quadratic time to build (integers equal modulo 2**61 - 1 all hash alike, and a program can send 100 000)."""
    if isinstance(items, (list, tuple)) and len(items) > 256:
        distinct = len({hash(x) for x in items if isinstance(x, (int, float, complex, tuple, frozenset))})
        numeric = sum(isinstance(x, (int, float, complex, tuple, frozenset)) for x in items)
        if numeric - distinct > max(64, numeric // 8):
            raise _Fail("keys whose hashes collide")
    return items


def decode(obj: Any, depth: int = 0) -> Any:
    """Tagged JSON (see ``_sandbox_child.encode``) to exact builtin values; ValueError for anything else."""
    if depth > 200:
        raise ValueError("nested too deeply")
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if type(obj) is list:
        return [decode(v, depth + 1) for v in obj]
    if type(obj) is not dict or set(obj) != {"__t", "v"}:
        raise ValueError("not a tagged value")
    tag, v = obj["__t"], obj["v"]
    if tag == "tuple" and type(v) is list:
        return tuple(decode(x, depth + 1) for x in v)
    if tag in ("set", "frozenset") and type(v) is list:
        return (set if tag == "set" else frozenset)(_spread([decode(x, depth + 1) for x in v]))
    if tag == "dict" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
        pairs = [(decode(k, depth + 1), decode(x, depth + 1)) for k, x in v]
        _spread([k for k, _ in pairs])
        return dict(pairs)
    if tag == "bytes" and type(v) is str:
        return bytes.fromhex(v)
    if tag == "int" and type(v) is str and len(v) <= MAX_INT_BITS // 4 + 3 and re.fullmatch(r"-?0x[0-9a-f]+", v):
        return int(v, 16)  # base 16: no decimal digit limit, linear time
    if tag == "complex" and type(v) is list and len(v) == 2 and all(type(x) in (int, float) for x in v):
        return complex(v[0], v[1])
    raise ValueError(f"unknown tag {str(tag)[:40]!r}")


def _spread(items: list) -> list:
    try:
        return spread_hashes(items)
    except _Fail as exc:
        raise ValueError(str(exc)) from None


MAX_DIVISION_BITS = 1 << 17  # long division is quadratic: both sides this large fail instead of taking minutes


def _int_guard(op: type, left: Any, right: Any) -> None:
    if not (type(left) is int and type(right) is int):
        return
    lb, rb = left.bit_length(), right.bit_length()
    if op in (ast.FloorDiv, ast.Mod, ast.Div) and min(lb, rb) > MAX_DIVISION_BITS:
        raise _Fail("division of two huge integers")
    if op is ast.Pow and right > 0 and abs(left) > 1 and lb * right > MAX_INT_BITS:
        raise _Fail("power too large")
    if op is ast.LShift and lb + right > MAX_INT_BITS:
        raise _Fail("shift too large")
    if op is ast.Mult and lb + rb > MAX_INT_BITS:
        raise _Fail("product too large")


def _format_guard(fmt: str) -> None:
    """A %-format or format spec whose widths and precisions are all small."""
    for m in _WIDTH_RE.finditer(fmt):
        if m.group(1) == "*" or int(m.group(1)) > MAX_WIDTH:
            raise _Fail("formatting width too large")


def guard(op: type, left: Any, right: Any) -> None:
    _int_guard(op, left, right)
    if op is ast.Pow and isinstance(right, (int, float)) and abs(right) > 4096 and type(left) is float:
        if abs(left) > 1:
            raise _Fail("power too large")
    if op is ast.Mult:
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and type(n) is int and n * max(1, len(seq)) > MAX_SIZE:
                raise _Fail("sequence too large")
    if op is ast.Mod and isinstance(left, (str, bytes)):
        _format_guard(left if isinstance(left, str) else left.decode("latin-1"))


def call_guard(fn: Any, args: list, kwargs: dict) -> None:
    if fn is format and len(args) > 1 and isinstance(args[1], str):
        _format_guard(args[1])
    if fn is range and len(range(*args)) > MAX_SIZE:
        raise _Fail("range too large")
    if fn is pow and len(args) == 2:
        guard(ast.Pow, args[0], args[1])
    if fn is pow and len(args) == 3 and type(args[2]) is int and args[2].bit_length() > MAX_DIVISION_BITS:
        raise _Fail("modular power with a huge modulus")
    if fn is divmod and len(args) == 2:
        guard(ast.FloorDiv, args[0], args[1])
    if fn in (set, frozenset, dict, collections.Counter) and args:
        spread_hashes(args[0])
    if fn in (math.factorial, math.comb, math.perm) and any(type(a) is int and a > 50_000 for a in args):
        raise _Fail("factorial too large")


def method_guard(base: Any, attr: str, args: list) -> None:
    if attr == "replace" and isinstance(base, (str, bytes)) and len(args) >= 2:
        grow = max(0, len(args[1]) - len(args[0])) * (base.count(args[0]) if args[0] else len(base) + 1)
        if len(base) + grow > MAX_SIZE:
            raise _Fail("replace result too large")
    if attr == "join" and isinstance(base, (str, bytes)) and args and isinstance(args[0], (list, tuple)):
        if len(base) * len(args[0]) > MAX_SIZE:
            raise _Fail("join result too large")


def checked(value: Any) -> Any:
    """A value computed here, refused when it is too large to keep."""
    t = type(value)
    if t is int and value.bit_length() > MAX_INT_BITS:
        raise _Fail("integer too large")
    if t in (str, bytes, list, tuple, dict, set, frozenset) and len(value) > MAX_SIZE:
        raise _Fail("value too large")
    return value


def truth(value: Any) -> bool:
    if isinstance(value, (Remote, Approx, Module)) or not isinstance(value, _PLAIN):
        raise _Fail("truth of a program object")
    return bool(value)


def plain_operands(*values: Any) -> None:
    for v in values:
        if isinstance(v, (Remote, Module)):
            raise _Fail("a program object in a comparison or arithmetic")


class Budget:
    """Operations and wall time left to one sample's grading."""

    def __init__(self, deadline: float) -> None:
        self.deadline, self.ops, self.decoded = deadline, 0, 0

    def decoding(self, obj: Any) -> None:
        """Count an answer's values against the sample's bound before it is decoded."""
        self.decoded += count_values(obj, MAX_DECODED - self.decoded)

    def tick(self, n: int = 1) -> None:
        self.ops += n
        if self.ops > MAX_OPS:
            raise _Fail("too many operations")
        if self.ops % 512 == 0 and time.monotonic() > self.deadline:
            raise _Fail("out of time")


def copy_back(args: list, mutated: dict, budget: Budget) -> None:
    """Arguments the program changed in place (``{position: tagged value}``) take its changes, as in one process."""
    for key, enc in mutated.items():
        i = int(key) if type(key) is str and key.isdigit() else -1
        if not 0 <= i < len(args) or type(args[i]) not in (list, dict, set, bytearray):
            continue
        budget.decoding(enc)
        try:
            new = checked(decode(enc))
        except (ValueError, TypeError, RecursionError) as exc:
            raise _Fail(f"undecodable argument ({exc})") from None
        if type(new) is not type(args[i]):
            raise _Fail("an argument changed type in place")
        if type(new) in (dict, set):
            args[i].clear()
            args[i].update(new)
        else:
            args[i][:] = new
