"""Local text data files read line by line before the ``datasets`` loader sees them, so that a bad file is refused
with its line number and the innermost cause, and no single row can take the machine's memory.

``scan_text_file`` runs on every ``.jsonl``/``.json``/``.csv`` file: each line is read with a bound
(``--max_row_bytes``) before anything parses it, checked to be UTF-8, and (JSON Lines) parsed on its own with
duplicate keys refused, and a lone UTF-16 surrogate escape (``"\\ud800"``, which parses into a string no file or
Arrow column holds) named with its column; a CSV header with a column twice is refused. A ``.json`` file holding
one document (an array or an object) cannot be bounded per row without parsing it; it is checked for UTF-8 in
chunks (the error names the line) and, when its bytes hold a surrogate escape, parsed to find a lone one; the
JSON loader's own error is made readable by ``json_problem`` when it fails.

``innermost`` digs the real cause out of an exception chain (``datasets`` wraps pyarrow's message in
``DatasetGenerationError: An error occurred while generating the dataset``).
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import re
from pathlib import Path
from typing import Any

from grpokit.errors import DataError

MAX_ROW_BYTES = 8 << 20  # --max_row_bytes default
_PREVIEW = 60
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # a UTF-16 surrogate escape: half of a pair
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def innermost(exc: BaseException) -> BaseException:
    """The last exception of the ``__cause__``/``__context__`` chain (the one that says what went wrong)."""
    seen = {id(exc)}
    while True:
        nxt = exc.__cause__ or exc.__context__
        if nxt is None or id(nxt) in seen:
            return exc
        seen.add(id(nxt))
        exc = nxt


def one_line(exc: BaseException) -> str:
    """``Type: first line`` of the innermost cause of ``exc``."""
    inner = innermost(exc)
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[0] if text else ''}"


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} bytes"


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _lines(path: Path, max_row_bytes: int, where: str):
    """(line number, text) of each line, each read with the bound and decoded as UTF-8; DataError naming the
    line otherwise. Blank lines are given too (the caller decides)."""
    with path.open("rb") as f:
        number = 0
        while True:
            raw = f.readline(max_row_bytes + 2)  # + the newline (\r\n) a full-size line ends with
            if not raw:
                return
            number += 1
            if len(raw.rstrip(b"\r\n")) > max_row_bytes:
                raise DataError(
                    f"{where}: line {number} is longer than --max_row_bytes {max_row_bytes} "
                    f"({_size(max_row_bytes)}); shorten the row or raise --max_row_bytes"
                )
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad = raw[exc.start : exc.start + 4]
                raise DataError(
                    f"{where}: line {number} is not UTF-8 (byte {exc.start + 1} of the line: {bad!r}); "
                    "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None
            yield number, text


def scan_text_file(path: Path, builder: str, where: str, max_row_bytes: int = MAX_ROW_BYTES) -> None:
    """Check a ``.jsonl``/``.json``/``.csv`` file line by line (see the module docstring); DataError naming the
    line and the cause of the first problem."""
    if isinstance(max_row_bytes, bool) or not isinstance(max_row_bytes, int) or max_row_bytes < 1:
        raise DataError(f"--max_row_bytes {max_row_bytes!r}: must be a positive number of bytes")
    if builder == "csv":
        _scan_csv(path, where, max_row_bytes)
        return
    if path.suffix.lower() == ".json" and _first_char(path) == b"[":
        _scan_document(path, where)  # one document: the bound does not apply to its lines, UTF-8 does
        return
    lines = _lines(path, max_row_bytes, where)
    first = next(((n, t) for n, t in lines if t.strip()), None)
    if first is None:
        return
    if path.suffix.lower() == ".json" and not _is_json_lines(first[1]):
        _scan_document(path, where)  # a pretty-printed object: one document too
        return
    row = 0
    for number, text in itertools.chain([first], lines):  # one line in memory at a time
        if text.strip():
            _json_line(text.rstrip("\r\n"), f"line {number} (row {row})", where)
            row += 1


def _first_char(path: Path) -> bytes:
    """The first byte that is not whitespace (nor a UTF-8 byte-order mark), b"" for a blank file."""
    with path.open("rb") as f:
        while chunk := f.read(1 << 16):
            stripped = chunk.lstrip(b" \t\r\n\xef\xbb\xbf")
            if stripped:
                return stripped[:1]
    return b""


def _scan_utf8(path: Path, where: str) -> None:
    """DataError naming the line of the first byte that is not UTF-8, read in 1 MiB chunks."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    line = 1
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                line += chunk.count(b"\n", 0, max(0, exc.start))
                raise DataError(
                    f"{where}: line {line} is not UTF-8; re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
                ) from None
            line += chunk.count(b"\n")
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise DataError(
            f"{where}: the file ends inside a UTF-8 character (a truncated file?); re-encode or re-copy it"
        ) from None


def _scan_document(path: Path, where: str) -> None:
    """A one-document ``.json`` file: UTF-8 throughout, and (only when its bytes hold a surrogate escape, which
    pyarrow reads as an empty string) no lone surrogate."""
    _scan_utf8(path, where)
    tail = b""
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            if _SURROGATE_BYTES.search(tail + chunk):
                problem = json_problem(path, where)
                if problem is not None:
                    raise DataError(f"{where}: {problem}")
                return
            tail = chunk[-5:]


def _is_json_lines(first_line: str) -> bool:
    """A ``.json`` file may hold JSON Lines (``datasets`` reads both): true when its first line is a whole object."""
    try:
        return isinstance(json.loads(first_line), dict)
    except ValueError:
        return False


def _json_line(text: str, line: str, where: str) -> None:
    try:
        row = json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        near = text[max(0, exc.pos - 20) : exc.pos + 20].strip()
        raise DataError(
            f"{where}: {line} column {exc.colno} is not valid JSON ({exc.msg}, near {near!r}); "
            "each line of a .jsonl file must be one JSON object"
        ) from None
    except ValueError as exc:  # a duplicate key
        raise DataError(f"{where}: {line} has a {exc}; give each column once") from None
    if not isinstance(row, dict):
        raise DataError(
            f"{where}: {line} is a JSON {type(row).__name__}, not an object; each line of a "
            '.jsonl file must be one object {{"column": value, ...}}'
        )
    if "\\u" in text and _SURROGATE.search(text):
        _check_surrogates(row, text, line, where)


def _check_surrogates(row: dict, text: str, line: str, where: str) -> None:
    """A ``\\ud800``-style escape that is half of a UTF-16 pair parses into a string no file or Arrow column
    can hold (``datasets`` then fails on the whole file with an unrelated message): named here with its column."""
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        pass
    else:
        return  # every escape was half of a pair, or an escaped backslash
    matches = list(_SURROGATE.finditer(text))
    column, k = matches[0].start() + 1, 0
    while k < len(matches):  # the first escape without its other half
        m = matches[k]
        high = m.group()[3].lower() in "89ab"
        after = matches[k + 1] if k + 1 < len(matches) else None
        if high and after is not None and after.start() == m.end() and after.group()[3].lower() in "cdef":
            k += 2
            continue
        column = m.start() + 1
        break
    escape = text[column - 1 : column + 5]
    raise DataError(
        f"{where}: {line} column {column} holds {escape}, a lone UTF-16 surrogate (half of a pair, not a "
        "character); fix the escape: a character beyond U+FFFF is written as a pair (\\ud83d\\ude00) or as "
        "itself"
    )


def _scan_csv(path: Path, where: str, max_row_bytes: int) -> None:
    lines = _lines(path, max_row_bytes, where)
    header = next(((n, t) for n, t in lines if t.strip()), None)
    if header is None:
        return
    names = next(csv.reader(io.StringIO(header[1].lstrip("\ufeff"))), [])
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise DataError(
                f"{where}: the header (line {header[0]}) names column {name!r} twice; give each column "
                "a name of its own"
            )
        seen.add(name)
    for _ in lines:  # every line bounded and UTF-8
        pass


def json_problem(path: Path, where: str) -> str | None:
    """For a ``.json`` document the loader refused: the parser's own line/column and message, or None."""
    try:
        with path.open(encoding="utf-8") as f:
            doc = json.load(f, object_pairs_hook=_unique_keys)
        json.dumps(doc, ensure_ascii=False).encode("utf-8")
    except json.JSONDecodeError as exc:
        return f"line {exc.lineno} column {exc.colno}: {exc.msg}"
    except UnicodeEncodeError:
        match = _SURROGATE.search(path.read_text(encoding="utf-8"))
        escape = f" ({match.group()})" if match else ""
        return f"it holds a lone UTF-16 surrogate escape{escape}, half of a pair and not a character; fix the escape"
    except ValueError as exc:
        return str(exc)
    except OSError:
        return None
    return None
