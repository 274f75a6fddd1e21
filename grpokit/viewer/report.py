"""The trajectory viewer's page: a run folder's logging.jsonl, completions.jsonl and args.json read into one
JSON value, and that value inlined with the viewer's script and styles and the vendored uPlot charting library
(static/, fetched by scripts/fetch_uplot.sh) into one HTML file that needs no server and no network.

Standard library only: `grpokit view` never imports torch.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path

from grpokit.errors import ConfigError

REPORT_NAME = "report.html"
MAX_COMPLETION_STEPS = 100  # steps whose completions the page holds (first, last and evenly spaced between)
STATIC = ("uPlot.iife.min.js", "uPlot.min.css", "app.js", "app.css")


MAX_ARGS_BYTES = 4 << 20


def read_rows(path: Path) -> list[dict]:
    """Every JSON-object line of a JSON-lines file; a line that does not parse (the torn last line of a file
    being written) is skipped. A missing file has no rows."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_bytes().split(b"\n"):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


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
    logs = read_rows(output_dir / "logging.jsonl")
    if not logs and not (output_dir / "completions.jsonl").exists() and not (output_dir / "args.json").exists():
        raise ConfigError(
            f"grpokit view: {output_dir} has no logging.jsonl, completions.jsonl or args.json; give "
            "the --output_dir of a grpokit run"
        )
    stamp = version(output_dir)
    by_step: dict[int, list[dict]] = {}
    for row in read_rows(output_dir / "completions.jsonl"):
        step = row.get("step")
        if isinstance(step, int):
            by_step.setdefault(step, []).append(row)
    kept = chosen_steps(sorted(by_step), max_completion_steps)
    args_path = output_dir / "args.json"
    try:  # a regular file of a few KiB: a FIFO is not waited on, a huge or deeply nested file not shown
        small = args_path.is_file() and args_path.stat().st_size <= MAX_ARGS_BYTES
        args = json.loads(args_path.read_text(encoding="utf-8")) if small else {}
    except (OSError, ValueError, RecursionError):
        args = {}
    return _finite(
        {
            "run": str(output_dir.resolve()),
            "version": stamp,
            "logs": logs,
            "args": args if isinstance(args, dict) else {},
            "completions": {str(s): by_step[s] for s in kept},
            "completion_steps": {"logged": len(by_step), "shown": len(kept), "limit": max_completion_steps},
        }
    )


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
        tmp.write_text(html, encoding="utf-8")
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConfigError(f"grpokit view: cannot write {path}: {e.strerror or e}; choose another --output") from e
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
