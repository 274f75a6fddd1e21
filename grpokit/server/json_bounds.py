"""How big a JSON body is once parsed, measured on its bytes before any parsing.

A small body can parse into far more memory than it takes: 53 MiB of ``{},`` becomes 18 million dicts, and one
60 MiB string is copied four times on its way through ``json.loads`` and the checks. The guard refuses a body with
more items (array elements and object members) than its endpoint's budget, nested deeper than ``MAX_BODY_DEPTH``, or
holding a string longer than its limit, before ``json.loads`` builds anything. Counting ``,``, ``[`` and ``{`` bytes
gives an upper bound at C speed, and a body no longer than the string limit cannot hold a longer string; only past
those are the bytes inside strings told apart (numpy, in slices, so the scan itself allocates a few MiB whatever
the body).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_BODY_DEPTH = 512  # nesting of a whole body (free-form values inside it are bounded tighter by the protocol)
_SLICE = 1 << 21  # bytes per numpy pass of the exact scan
_BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte but the brackets, for bytes.translate's delete
_QUOTE, _COMMA, _OPEN_A, _OPEN_O, _CLOSE_A, _CLOSE_O = (ord(c) for c in '",[{]}')


@dataclass(frozen=True)
class JsonSize:
    items: int  # array elements and object members (an upper bound: a scalar body counts 0, `[]` counts 1)
    depth: int  # deepest nesting of arrays and objects
    longest: int  # characters of the longest string (an upper bound: the body's length when not measured)


def _upper_bound(body: bytes, max_items: int) -> JsonSize | None:
    """Counts that include the brackets and commas inside strings (so never below the true figures); None when
    the item count alone is over ``max_items`` (its depth is not worth computing then)."""
    items = body.count(b",") + body.count(b"[") + body.count(b"{")
    if items > max_items:
        return None
    brackets = np.frombuffer(body.translate(None, _BRACKETS), dtype=np.uint8)  # at most 2 x items of them
    if brackets.size == 0:
        return JsonSize(items, 0, len(body))
    step = np.where((brackets == _OPEN_A) | (brackets == _OPEN_O), 1, -1).astype(np.int32)
    return JsonSize(items, int(np.cumsum(step, dtype=np.int32).max()), len(body))


def _exact(body: bytes, max_items: int, max_depth: int, max_string: int) -> JsonSize:
    """Counts outside strings only, and string lengths, up to the first slice that passes a limit. Escapes are
    removed first: pairs of backslashes, then escaped quotes (the left-to-right pairing JSON's own reading does), so
    every quote left opens or closes a string (lengths are then counted without their escapes)."""
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    inside, depth, deepest, items, longest = 0, 0, 0, 0, 0
    open_at: int | None = None  # where the string still open at the end of the last slice began
    for start in range(0, len(text), _SLICE):
        a = np.frombuffer(text, dtype=np.uint8, count=min(_SLICE, len(text) - start), offset=start)
        quotes = a == _QUOTE
        outside = ((np.cumsum(quotes, dtype=np.int32) + inside) & 1) == 0  # a closing quote itself reads as outside
        where = np.flatnonzero(quotes) + start
        if open_at is not None and where.size:
            longest = max(longest, int(where[0]) - open_at - 1)
            where, open_at = where[1:], None
        if where.size % 2:
            open_at, where = int(where[-1]), where[:-1]
        if where.size:
            longest = max(longest, int((where[1::2] - where[0::2]).max()) - 1)
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
        if open_at is not None:
            longest = max(longest, start + a.size - open_at - 1)
        if items > max_items or deepest > max_depth or longest > max_string:
            break  # over a limit: the rest does not change the answer
    return JsonSize(items, deepest, longest)


def json_size(body: bytes, max_items: int, max_string: int, max_depth: int = MAX_BODY_DEPTH) -> JsonSize:
    """The body's items, depth and longest string: the quick upper bounds when they are within the limits, else
    the exact figures (the scan stops early once past a limit, so a refused body's figures are lower bounds)."""
    bound = _upper_bound(body, max_items)
    if bound is not None and bound.depth <= max_depth and len(body) <= max_string:
        return bound
    return _exact(body, max_items, max_depth, max_string)
