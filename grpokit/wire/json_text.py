"""``json.loads`` for text nobody vouches for: a tool call's arguments, a model's completion, a row of a run's log.

Python's parser has two failure modes that are not ``JSONDecodeError``: a number of more than 4,300 digits raises a
plain ``ValueError`` (int conversion limit) and nesting past the recursion limit raises ``RecursionError``, both
after work proportional to the input. ``loads`` measures the nesting on the text first (strings blanked out by one
regex, brackets summed at C speed), refuses long numbers in the parser's own hooks, and raises ``JsonTextError``
(a ``ValueError``) for every way the text can fail, so one ``except`` covers them all.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

MAX_DEPTH = 64  # arrays and objects inside one another
MAX_NUMBER_CHARS = 100  # a float's 17 significant digits and exponent, or an int of up to 2**330, fit
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class JsonTextError(ValueError):
    """Text that is not JSON within the bounds (``loads``); the message says which bound or where it fails."""


def depth(text: str) -> int:
    """The deepest nesting of arrays and objects in ``text`` (brackets inside strings not counted)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not brackets:
        return 0
    return max(accumulate(_STEP[ord(c)] for c in brackets))


def _number(kind: type, limit: int):
    def parse(text: str):
        if len(text) > limit:
            raise JsonTextError(f"a number of {len(text)} characters (at most {limit})")
        return kind(text)

    return parse


def loads(
    text: str | bytes, *, max_depth: int = MAX_DEPTH, max_number_chars: int = MAX_NUMBER_CHARS, what: str = "JSON"
) -> Any:
    """``json.loads(text)``; JsonTextError naming ``what`` when it is not JSON, nests deeper than ``max_depth``,
    holds a number longer than ``max_number_chars`` or is not UTF-8."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JsonTextError(f"{what}: not UTF-8 (byte {e.start})") from None
    deepest = depth(text)
    if deepest > max_depth:
        raise JsonTextError(f"{what}: nests deeper than {max_depth} levels ({deepest})")
    try:
        return json.loads(text, parse_int=_number(int, max_number_chars), parse_float=_number(float, max_number_chars))
    except JsonTextError as e:
        raise JsonTextError(f"{what}: {e}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, and what the checks above already rule out
        raise JsonTextError(f"{what}: not valid JSON ({str(e)[:120]})") from None
