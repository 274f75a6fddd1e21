"""Bad data files are refused in one line naming the line/row and the innermost cause (issue 27)."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest

from grpokit.data.files import innermost, one_line, scan_text_file
from grpokit.data.loading import RowOptions, load_train_val
from grpokit.errors import DataError

GOOD = '{"query": "1 + 1?", "solution": "2"}\n'


def load(path: Path, **opts):
    return load_train_val([str(path)], [], system=None, seed=0, options=RowOptions(**opts))[0]


def refused(path: Path, **opts) -> str:
    with pytest.raises(DataError) as err:
        load(path, **opts)
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"--dataset {str(path)!r}: "), msg
    return msg


CASES = {
    "malformed jsonl line": (
        "data.jsonl",
        (GOOD + '{"query": "2 + 2?", "solution": "4"\n').encode(),
        ["line 2 (row 1) column 36 is not valid JSON (Expecting ',' delimiter"],
    ),
    "duplicate json keys": (
        "data.jsonl",
        (GOOD + '{"query": "a", "query": "b", "solution": "4"}\n').encode(),
        ["line 2 (row 1) has a duplicate key 'query'; give each column once"],
    ),
    "a jsonl line that is not an object": (
        "data.jsonl",
        (GOOD + "[1, 2]\n").encode(),
        ["line 2 (row 1) is a JSON list, not an object"],
    ),
    "non-utf-8 bytes in jsonl": (
        "data.jsonl",
        (GOOD + GOOD + '{"query": "caf').encode() + b"\xe9" + b'", "solution": "1"}\n',
        ["line 3 is not UTF-8 (byte 15 of the line: b'\\xe9\"", "re-encode the file as UTF-8"],
    ),
    "non-utf-8 bytes in csv": (
        "data.csv",
        b"query,solution\n1 + 1?,2\ncaf\xe9,3\n",
        ["line 3 is not UTF-8 (byte 4 of the line"],
    ),
    "duplicate csv header": (
        "data.csv",
        b"query,solution,query\n1 + 1?,2,x\n",
        ["the header (line 1) names column 'query' twice"],
    ),
    "non-utf-8 bytes in a json document": (
        "data.json",
        b'[{"query": "1 + 1?", "solution": "2"},\n {"query": "\xff", "solution": "3"}]\n',
        ["line 2 is not UTF-8"],
    ),
    "malformed json document": (
        "data.json",
        b'[{"query": "1 + 1?", "solution": "2"},\n {"query": "x" "solution": "3"}]\n',
        ["could not read the json file (line 2 column 16: Expecting ',' delimiter)"],
    ),
    "unknown role": (
        "data.jsonl",
        json.dumps({"messages": [{"role": "usr", "content": "hi"}], "solution": "1"}).encode() + b"\n",
        ["row 0: column 'messages': unknown role 'usr'; use one of system, user, assistant, tool"],
    ),
    "a lone surrogate escape in jsonl": (
        "data.jsonl",
        (GOOD + '{"query": "ok \\ud83d\\ude00 then \\ud800 here", "solution": "4"}\n' + GOOD).encode(),
        ["line 2 (row 1) column 33 holds \\ud800, a lone UTF-16 surrogate", "fix the escape"],
    ),
    "a low surrogate alone in jsonl": (
        "data.jsonl",
        (GOOD + '{"query": "x", "solution": "\\uDC00"}\n').encode(),
        ["line 2 (row 1) column 29 holds \\uDC00, a lone UTF-16 surrogate"],
    ),
    "a lone surrogate escape in a json document": (
        "data.json",
        b'[{"query": "1 + 1?", "solution": "2"},\n {"query": "\\udbff", "solution": "3"}]\n',
        ["lone UTF-16 surrogate escape (\\udbff)"],
    ),
    "a row longer than --max_row_bytes": (
        "data.jsonl",
        (GOOD + json.dumps({"query": "x" * 5000, "solution": "1"}) + "\n").encode(),
        ["line 2 is longer than --max_row_bytes 4096 (4096 bytes); shorten the row or raise --max_row_bytes"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_file_is_refused_naming_the_line_and_cause(case, tmp_path):
    name, content, needles = CASES[case]
    path = tmp_path / name
    path.write_bytes(content)
    msg = refused(path, max_row_bytes=4096)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_good_files_still_load(tmp_path):
    (tmp_path / "a.jsonl").write_text(GOOD * 3 + "\n")  # a trailing blank line is fine
    (tmp_path / "b.csv").write_text("query,solution\n1 + 1?,2\n")
    (tmp_path / "c.json").write_text(json.dumps([json.loads(GOOD)] * 2))
    (tmp_path / "d.json").write_text(GOOD * 2)  # JSON Lines in a .json file, as datasets reads it
    # a pair of surrogate escapes is one character; an escaped backslash before "ud800" is no escape at all
    (tmp_path / "e.jsonl").write_text('{"query": "1 + 1?", "solution": "\\ud83d\\ude00 \\\\ud800"}\n')
    for name, rows in (("a.jsonl", 3), ("b.csv", 1), ("c.json", 2), ("d.json", 2), ("e.jsonl", 1)):
        ds = load(tmp_path / name)
        assert len(ds) == rows and ds[0]["messages"][-1]["content"] == "1 + 1?"


def test_a_huge_line_is_refused_without_reading_it_whole(tmp_path):
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        f.write(GOOD)
        f.write('{"query": "' + "x" * (64 << 20) + '", "solution": "1"}\n')  # 64 MiB on one line
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(DataError, match=r"line 2 is longer than --max_row_bytes 8388608 \(8.0 MiB\)"):
        scan_text_file(path, "json", "--dataset big.jsonl")
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 32, grown_mib  # at most the bound's worth of the line was read, never the 64 MiB


@pytest.mark.parametrize("bad", [0, -5, True, 1.5])
def test_max_row_bytes_must_be_positive(bad, tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(GOOD)
    with pytest.raises(DataError, match=r"--max_row_bytes .*must be a positive number of bytes"):
        scan_text_file(path, "json", "--dataset a.jsonl", bad)


def test_the_innermost_cause_is_named():
    try:
        try:
            raise ValueError("JSON parse error: Missing a comma\nmore")
        except ValueError as inner:
            raise RuntimeError("An error occurred while generating the dataset") from inner
    except RuntimeError as outer:
        assert innermost(outer).args[0].startswith("JSON parse error")
        assert one_line(outer) == "ValueError: JSON parse error: Missing a comma"


def test_a_json_document_on_one_line_is_not_bounded_per_line(tmp_path):
    path = tmp_path / "one_line.json"
    path.write_text(json.dumps([json.loads(GOOD)] * 20))  # ~800 bytes on one line, rows of 40
    assert len(load(path, max_row_bytes=100)) == 20
    pretty = tmp_path / "pretty.json"
    pretty.write_bytes(b'[\n  {"query": "1 + 1?", "solution": "2"},\n  {"query": "\xff", "solution": "3"}\n]\n')
    with pytest.raises(DataError, match=r"line 3 is not UTF-8; re-encode"):
        load(pretty)
