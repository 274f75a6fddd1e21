"""numpy's ``allclose`` and ``isclose`` on plain values, with numpy's semantics: the grader's stand-ins.

The arguments become arrays as ``numpy.asarray`` makes them (a ragged nesting is an error), their shapes broadcast
by numpy's rule (a mismatch is numpy's ValueError, so the check fails as it would under numpy: ``[1, 2]`` against
``[1, 2, 3]``), and an empty broadcast is ``allclose`` True, as in numpy (``[]`` against ``[[], [], []]``).
``isclose`` of two scalars is a bool; of arrays, an ``Elementwise`` result whose truth is numpy's: the one element's
for a single element, an error ("ambiguous") for more or none.
"""

from __future__ import annotations

import math
from typing import Any

MAX_ELEMENTS = 1_000_000


def _shape(x: Any) -> tuple[int, ...]:
    if type(x) in (list, tuple) or isinstance(x, Elementwise):
        inner = {_shape(v) for v in x}
        if len(inner) > 1:
            raise ValueError("setting an array element with a sequence: the nested lists are inhomogeneous")
        return (len(x), *(inner.pop() if inner else ()))
    if type(x) is bool or isinstance(x, (int, float)):
        return ()
    raise TypeError(f"numpy would not compare a {type(x).__name__} as a number")


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    if any(x != y and 1 not in (x, y) for x, y in zip(a, b)):
        raise ValueError(f"operands could not be broadcast together with shapes {a} {b}")
    out = tuple(max(x, y) if 0 not in (x, y) else 0 for x, y in zip(a, b))
    if math.prod(out) > MAX_ELEMENTS:
        raise ValueError("arrays too large for the grader")
    return out


def _at(x: Any, shape: tuple[int, ...], index: tuple[int, ...]) -> Any:
    """Element ``index`` of the broadcast of ``x`` (its own shape ``shape``) to the result's shape."""
    skip = len(index) - len(shape)
    for dim, i in zip(shape, index[skip:]):
        x = x[0 if dim == 1 else i]
    return x


def _close(a: Any, b: Any, rtol: float, atol: float, equal_nan: bool) -> bool:
    if math.isnan(a) or math.isnan(b):
        return bool(equal_nan and math.isnan(a) and math.isnan(b))
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * abs(b)


def _elementwise(a: Any, b: Any, rtol: float, atol: float, equal_nan: bool) -> Any:
    sa, sb = _shape(a), _shape(b)
    out = _broadcast(sa, sb)

    def build(prefix: tuple[int, ...]) -> Any:
        if len(prefix) == len(out):
            return _close(_at(a, sa, prefix), _at(b, sb, prefix), rtol, atol, equal_nan)
        return Elementwise(build((*prefix, i)) for i in range(out[len(prefix)]))

    return build(())


class Elementwise(tuple):
    """numpy's boolean array from ``isclose``: its truth is numpy's (see the module docstring)."""

    def __bool__(self) -> bool:
        if len(self) != 1:
            raise ValueError("the truth value of an array with more than one element (or none) is ambiguous")
        return bool(self[0])

    def all(self) -> bool:
        return all(v.all() if isinstance(v, Elementwise) else v for v in self)

    def any(self) -> bool:
        return any(v.any() if isinstance(v, Elementwise) else v for v in self)


def isclose(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False) -> Any:
    return _elementwise(a, b, rtol, atol, equal_nan)


def allclose(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False) -> bool:
    result = _elementwise(a, b, rtol, atol, equal_nan)
    return result.all() if isinstance(result, Elementwise) else result
