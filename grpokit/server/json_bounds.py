"""How big a JSON body is once parsed, measured on its bytes before any parsing.

A small body can parse into far more memory than it takes: 53 MiB of ``{},`` becomes 18 million dicts, and one
60 MiB string is copied four times on its way through ``json.loads`` and the checks. The guard refuses a body with
more items (array elements and object members) than its endpoint's budget, nested deeper than ``MAX_BODY_DEPTH``, or
holding a string longer than its limit, before ``json.loads`` builds anything. Only quotes, brackets and commas
are kept (``bytes.translate`` at C speed), and the bytes inside strings told apart with numpy in slices; a body no
longer than the string limit cannot hold a longer string, so only longer ones have their strings measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_BODY_DEPTH = 512  # nesting of a whole body (free-form values inside it are bounded tighter by the protocol)
_SLICE = 1 << 21  # bytes per numpy pass
_NOT_STRUCTURE = bytes(c for c in range(256) if chr(c) not in '"[]{},')  # deleted before counting
_QUOTE, _COMMA, _OPEN_A, _OPEN_O, _CLOSE_A, _CLOSE_O = (ord(c) for c in '",[{]}')


@dataclass(frozen=True)
class JsonSize:
    items: int  # array elements and object members (a non-empty container counts its elements, an empty one 1)
    depth: int  # deepest nesting of arrays and objects
    longest: int  # characters of the longest string, escapes not counted (the body's length when not measured)


def _unescaped(body: bytes) -> bytes:
    """The body without escaped backslashes and escaped quotes (paired left to right, as JSON reads them): every
    quote left opens or closes a string. ``bytes.replace`` returns the body itself when there is nothing to remove."""
    return body.replace(b"\\\\", b"").replace(b'\\"', b"")


def _structure(marks: bytes, max_items: int, max_depth: int) -> tuple[int, int]:
    """(items, depth) of a body reduced to its quotes, brackets and commas, up to the first slice past a limit."""
    inside, depth, deepest, items = 0, 0, 0, 0
    for start in range(0, len(marks), _SLICE):
        a = np.frombuffer(marks, dtype=np.uint8, count=min(_SLICE, len(marks) - start), offset=start)
        quotes = a == _QUOTE
        outside = ((np.cumsum(quotes, dtype=np.int32) + inside) & 1) == 0  # a closing quote itself reads as outside
        inside = (inside + int(quotes.sum())) & 1
        opens = outside & ((a == _OPEN_A) | (a == _OPEN_O))
        closes = outside & ((a == _CLOSE_A) | (a == _CLOSE_O))
        items += int((outside & (a == _COMMA)).sum()) + int(opens.sum())
        if opens.any():
            level = np.cumsum(opens.astype(np.int32) - closes.astype(np.int32)) + depth
            deepest = max(deepest, int(level.max()))
            depth = int(level[-1])
        else:
            depth -= int(closes.sum())
        if items > max_items or deepest > max_depth:
            break  # over a limit: the rest does not change the answer
    return items, deepest


def _longest(text: bytes, max_string: int) -> int:
    """The longest string of an unescaped body (quote to quote), up to the first slice where one passes the limit."""
    longest, open_at = 0, None
    for start in range(0, len(text), _SLICE):
        a = np.frombuffer(text, dtype=np.uint8, count=min(_SLICE, len(text) - start), offset=start)
        where = np.flatnonzero(a == _QUOTE) + start
        if open_at is not None and where.size:
            longest = max(longest, int(where[0]) - open_at - 1)
            where, open_at = where[1:], None
        if where.size % 2:
            open_at, where = int(where[-1]), where[:-1]
        if where.size:
            longest = max(longest, int((where[1::2] - where[0::2]).max()) - 1)
        if open_at is not None:
            longest = max(longest, start + a.size - open_at - 1)
        if longest > max_string:
            break
    return longest


def json_size(body: bytes, max_items: int, max_string: int, max_depth: int = MAX_BODY_DEPTH) -> JsonSize:
    """The body's items, depth and longest string (the string only measured in a body longer than
    ``max_string``). Scans stop once past a limit, so a refused body's figures are lower bounds."""
    text = _unescaped(body)
    items, depth = _structure(text.translate(None, _NOT_STRUCTURE), max_items, max_depth)
    longest = len(body) if len(body) <= max_string else _longest(text, max_string)
    return JsonSize(items, depth, longest)
