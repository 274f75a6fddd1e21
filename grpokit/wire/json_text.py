"""``json.loads`` for text nobody vouches for: a tool call's arguments, a model's completion, a row of a run's log.

Python's parser has two failure modes that are not ``JSONDecodeError``: a number of more than 4,300 digits raises a
plain ``ValueError`` (int conversion limit) and nesting past the recursion limit raises ``RecursionError``, both
after work proportional to the input. It also accepts what JSON is not: ``NaN`` and ``Infinity``, an object naming
one key twice (the last wins: two readers of one text may see different values), and ``\\ud800`` escapes that decode
to a lone UTF-16 surrogate (a string no UTF-8 writer can write back). ``loads`` measures the nesting on the text
first (strings blanked out by one regex, brackets summed at C speed), refuses long numbers, the constants and
repeated keys in the parser's own hooks and lone surrogates after parsing (only text with such an escape is
looked at), and raises ``JsonTextError`` (a ``ValueError``) for every way the text can fail, so one ``except``
covers them all.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

MAX_DEPTH = 64  # arrays and objects inside one another
MAX_NUMBER_CHARS = 100  # a float's 17 significant digits and exponent, or an int of up to 2**330, fit
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class JsonTextError(ValueError):
    """Text that is not JSON within the bounds (``loads``); the message says which bound or where it fails."""


def depth(text: str) -> int:
    """The deepest nesting of arrays and objects in ``text`` (brackets inside strings not counted)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not brackets:
        return 0
    return max(accumulate(_STEP[ord(c)] for c in brackets))


def bounded_number(kind: type, limit: int, finite: bool):
    """A ``parse_int``/``parse_float`` hook: JsonTextError for a number longer than ``limit`` characters (and, with
    ``finite``, for a float out of range)."""

    def parse(text: str):
        if len(text) > limit:
            raise JsonTextError(f"a number of {len(text)} characters (at most {limit})")
        value = kind(text)
        if finite and kind is float and not math.isfinite(value):
            raise JsonTextError(f"{text[:40]} is out of a float's range")
        return value

    return parse


def _constant(name: str):
    raise JsonTextError(f"{name} is no JSON number")


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    """An ``object_pairs_hook``: the object, or JsonTextError when it names a key twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise JsonTextError(f"key {twice[:40]!r} appears twice in one object")
    return out


def _check_unicode(value: Any) -> None:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise JsonTextError(f"a lone UTF-16 surrogate ({e.object[e.start : e.end]!r})") from None


def loads(
    text: str | bytes,
    *,
    max_depth: int | None = MAX_DEPTH,
    max_number_chars: int = MAX_NUMBER_CHARS,
    what: str = "JSON",
    finite: bool = True,
    surrogates: bool = True,
) -> Any:
    """``json.loads(text)``; JsonTextError naming ``what`` when it is not JSON, nests deeper than ``max_depth``
    (None: measured by the caller already), holds a number longer than ``max_number_chars``, ``NaN`` or
    ``Infinity``, a key twice in one object or a lone surrogate, or is not UTF-8. ``finite=False`` takes ``NaN`` and
    ``Infinity`` (what Python's own ``json.dumps`` writes for them: a run's logged losses); ``surrogates=False``
    leaves lone surrogates to the caller (an HTTP body's schema names where one is)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JsonTextError(f"{what}: not UTF-8 (byte {e.start})") from None
    deepest = depth(text) if max_depth is not None else 0
    if max_depth is not None and deepest > max_depth:
        raise JsonTextError(f"{what}: nests deeper than {max_depth} levels ({deepest})")
    try:
        value = json.loads(
            text,
            parse_int=bounded_number(int, max_number_chars, finite),
            parse_float=bounded_number(float, max_number_chars, finite),
            parse_constant=_constant if finite else float,
            object_pairs_hook=unique_pairs,
        )
        if surrogates and _SURROGATE_ESCAPE.search(text):
            _check_unicode(value)
        return value
    except JsonTextError as e:
        raise JsonTextError(f"{what}: {e}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, and what the checks above already rule out
        raise JsonTextError(f"{what}: not valid JSON ({str(e)[:120]})") from None
