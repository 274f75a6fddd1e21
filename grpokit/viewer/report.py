"""The trajectory viewer's page: a run folder's logging.jsonl, completions.jsonl and args.json read into one
JSON value, and that value inlined with the viewer's script and styles and the vendored uPlot charting library
(static/, fetched by scripts/fetch_uplot.sh) into one HTML file that needs no server and no network.

Every row is untrusted input: a line that is not a JSON object within bounds, or a row of the wrong shape, is
skipped and counted (``skipped_rows``), never an error. The files are streamed: memory follows what the page
shows (``max_completion_steps`` steps, at most ``MAX_SHOWN_BYTES`` of completion rows), not the size of the
history. The page names the run's folder, never a local absolute path, and shows its options without secrets.

Standard library only: `grpokit view` never imports torch.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path, PurePath

from grpokit.errors import ConfigError
from grpokit.redaction import redacted
from grpokit.wire.json_text import loads

REPORT_NAME = "report.html"
MAX_COMPLETION_STEPS = 100  # steps whose completions the page holds (first, last and evenly spaced between)
STATIC = ("uPlot.iife.min.js", "uPlot.min.css", "app.js", "app.css")
MAX_ROW_DEPTH = 32  # the rows grpokit writes nest a few levels; a deeper one is not a row of its own
MAX_ARGS_BYTES = 4 << 20  # an args.json is a few KiB: a file of MiBs is not a run's options
MAX_LINE_BYTES = 16 << 20  # one completion row (its token data is bounded by --log_completions_max_tokens)
MAX_SHOWN_BYTES = 64 << 20  # completion rows the page holds, all steps together; the rest are skipped, counted
MAX_STEPS = 200_000  # distinct steps of completion rows a page chooses from (a run logs one per optimizer step)
MAX_LOG_ROWS = 100_000  # logging.jsonl rows the charts draw; later rows are skipped, counted


@dataclass
class Skipped:
    """Rows left out of the page, by file: lines that are not a JSON object within bounds (torn, too deep, a huge
    number, not UTF-8 or a lone surrogate), rows of the wrong shape, rows past the page's byte budget."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


def _row(line: bytes) -> dict | None:
    """A line as a JSON object whose every string can be written back as UTF-8, or None."""
    try:
        row = loads(line, max_depth=MAX_ROW_DEPTH, finite=False)  # a logged NaN loss is shown as none
        if not isinstance(row, dict):
            return None
        json.dumps(row, ensure_ascii=False, allow_nan=True).encode("utf-8")  # a lone surrogate fails here
    except (ValueError, RecursionError):  # JsonTextError, UnicodeEncodeError
        return None
    return row


def _lines(path: Path):
    """(byte offset, line) of every non-empty line, read in bounded pieces (a line past ``MAX_LINE_BYTES`` is
    yielded empty: it is skipped, never held)."""
    if not path.is_file():
        return
    with path.open("rb") as f:
        offset = 0
        while True:
            line = f.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            start, offset = offset, offset + len(line)
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                while line and not line.endswith(b"\n"):  # the rest of the long line, dropped piece by piece
                    line = f.readline(MAX_LINE_BYTES + 1)
                    offset += len(line)
                yield start, b""
            elif line.strip():
                yield start, line


def read_rows(path: Path, skipped: Skipped | None = None) -> list[dict]:
    """Every JSON-object line with an integer ``step`` of a JSON-lines file, streamed; a line that fails for any
    reason (the torn last line of a file being written, a hostile row) is skipped and counted. A missing file has
    no rows."""
    rows = []
    for _, line in _lines(path):
        row = _row(line) if line else None
        if row is None or _step(row) is None or len(rows) >= MAX_LOG_ROWS:
            if skipped is not None:
                skipped.add(path.name)
            continue
        rows.append(row)
    return rows


def _step(row: dict) -> int | None:
    step = row.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def completions_by_step(path: Path, limit: int, skipped: Skipped) -> tuple[dict[int, list[dict]], int]:
    """The completion rows of at most ``limit`` steps (``chosen_steps``) and the number of steps logged, in two
    streamed passes: the distinct steps first (at most ``MAX_STEPS``; rows of further steps are skipped), then the
    rows of the chosen steps, up to ``MAX_SHOWN_BYTES`` of them. Memory is bounded by what the page shows and the
    count of steps, not by the file's lines."""
    if not path.is_file():
        return {}, 0
    steps: set[int] = set()
    for _, line in _lines(path):
        row = _row(line) if line else None
        step = None if row is None else _step(row)
        if step is None or (step not in steps and len(steps) >= MAX_STEPS):
            skipped.add(path.name)
            continue
        steps.add(step)
    kept = chosen_steps(sorted(steps), limit)
    by_step: dict[int, list[dict]] = {s: [] for s in kept}
    budget = MAX_SHOWN_BYTES
    for _, line in _lines(path):  # the file may have grown since: rows of other steps are left out, not counted
        row = _row(line) if line else None
        step = None if row is None else _step(row)
        if step not in by_step:
            continue
        if len(line) > budget:
            skipped.add(path.name)  # past the page's byte budget
            continue
        budget -= len(line)
        by_step[step].append(row)
    return by_step, len(steps)


def version(output_dir: Path) -> str:
    """Changes whenever one of the files the page shows does (size and modification time of each)."""
    parts = []
    for name in ("logging.jsonl", "completions.jsonl", "args.json"):
        try:
            st = (output_dir / name).stat()
            parts.append(f"{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            parts.append("-")
    return "/".join(parts)


def chosen_steps(steps: list[int], limit: int) -> list[int]:
    """At most ``limit`` of the sorted ``steps``: all of them when they fit, else the first, the last and evenly
    spaced ones between."""
    if len(steps) <= limit:
        return steps
    if limit == 1:
        return [steps[-1]]
    picks = {round(i * (len(steps) - 1) / (limit - 1)) for i in range(limit)}
    return [steps[i] for i in sorted(picks)]


def report_data(output_dir: Path, max_completion_steps: int = MAX_COMPLETION_STEPS) -> dict:
    """What the page shows, as one JSON-ready value: the log rows, the completion rows of the chosen steps, the
    run's options, and ``version`` (see ``version``)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise ConfigError(f"grpokit view: {output_dir} is not a folder; give a run's --output_dir")
    skipped = Skipped()
    logs = read_rows(output_dir / "logging.jsonl", skipped)
    if not logs and not (output_dir / "completions.jsonl").exists() and not (output_dir / "args.json").exists():
        raise ConfigError(
            f"grpokit view: {output_dir} has no logging.jsonl, completions.jsonl or args.json; give "
            "the --output_dir of a grpokit run"
        )
    stamp = version(output_dir)
    by_step, logged = completions_by_step(output_dir / "completions.jsonl", max_completion_steps, skipped)
    args_path = output_dir / "args.json"
    try:  # a regular file of at most MAX_ARGS_BYTES (a FIFO is not waited on, a huge file not shown); _row bounds
        # its depth
        small = args_path.is_file() and args_path.stat().st_size <= MAX_ARGS_BYTES
        args = _row(args_path.read_bytes()) if small else None
    except OSError:
        args = None
    return _finite(
        {
            "run": output_dir.resolve().name,  # the folder's name only: the page is shared, local paths stay here
            "version": stamp,
            "logs": logs,
            "args": _shareable(args) if args is not None else {},
            "completions": {str(s): rows for s, rows in by_step.items()},
            "completion_steps": {"logged": logged, "shown": len(by_step), "limit": max_completion_steps},
            "skipped_rows": skipped.counts,
        }
    )


def _shareable(args: dict) -> dict:
    """The run's options without secrets (an args.json written before they were redacted) and without local
    absolute paths (shown from the folder or file name on)."""
    return {k: _no_local_path(v) for k, v in redacted(args).items()}


def _no_local_path(value):
    if isinstance(value, str) and (value.startswith(("/", "~", "\\")) or re.match(r"[A-Za-z]:[\\/]", value)):
        name = PurePath(value.replace("\\", "/")).name
        return f".../{name}" if name else "..."
    if isinstance(value, list):
        return [_no_local_path(v) for v in value]
    return value


def render_html(data: dict, *, live: bool = False) -> str:
    """The self-contained page: the data as an inline JSON script, then uPlot and the viewer's script and styles.
    ``live``: the page polls ``version`` and ``data.json`` next to it (``grpokit view --serve``)."""
    static = {
        name: (resources.files("grpokit.viewer") / "static" / name).read_text(encoding="utf-8") for name in STATIC
    }
    # "<" written as \u003c: no text in the data can close the script element ("</script>") or open a comment
    payload = json.dumps(data, ensure_ascii=False, allow_nan=False).replace("<", "\\u003c")
    title = _escape(Path(data.get("run", "run")).name)
    return "\n".join(
        [
            "<!doctype html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>grpokit · {title}</title>",
            f"<style>{static['uPlot.min.css']}</style>",
            f"<style>{static['app.css']}</style>",
            "</head>",
            f'<body data-live="{1 if live else 0}">',
            f'<script type="application/json" id="grpokit-data">{payload}</script>',
            f"<script>{_script(static['uPlot.iife.min.js'])}</script>",
            f"<script>{_script(static['app.js'])}</script>",
            "</body></html>",
            "",
        ]
    )


def write_report(
    output_dir: Path, output: Path | None = None, max_completion_steps: int = MAX_COMPLETION_STEPS
) -> Path:
    """Write the page for the run in ``output_dir`` (to ``output``, default output_dir/report.html) atomically
    and return its path."""
    output_dir = Path(output_dir)
    path = Path(output) if output is not None else output_dir / REPORT_NAME
    html = render_html(report_data(output_dir, max_completion_steps))
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(html.encode("utf-8"))
        tmp.replace(path)
    except OSError as e:
        raise ConfigError(f"grpokit view: cannot write {path}: {e.strerror or e}; choose another --output") from e
    finally:
        tmp.unlink(missing_ok=True)  # after a replace there is none; after any failure none is left behind
    return path


def _finite(x):
    """``x`` with NaN and infinities as None (JSON has no NaN; a NaN loss still shows, as a gap)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def _script(text: str) -> str:
    if "</script" in text.lower():
        raise ConfigError("grpokit view: a bundled script contains </script>; reinstall grpokit")
    return text


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
