"""What a run leaves in output_dir: logging.jsonl, completions.jsonl, plots, and the end-of-run summary."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpokit.distributed.processes import MAX_METRICS
from grpokit.errors import ConfigError
from grpokit.runs.run_dir import atomic_write_text, output_errors


class MetricsAccumulator:
    """Averages scalar metrics over the micro-steps of one optimizer step (the ``MAX_METRICS``: their maximum)."""

    def __init__(self) -> None:
        self._sum: dict[str, float] = defaultdict(float)
        self._count: dict[str, int] = defaultdict(int)

    def add(self, metrics: dict[str, Any]) -> None:
        for k, v in metrics.items():
            v = float(v.item() if hasattr(v, "item") else v)  # NaN is kept: a NaN loss must show in the log
            if k in MAX_METRICS:
                self._sum[k] = max(self._sum[k], v) if self._count[k] else v
            else:
                self._sum[k] += v
            self._count[k] += 1

    def pop(self) -> dict[str, float]:
        out = {k: self._sum[k] if k in MAX_METRICS else self._sum[k] / self._count[k] for k in self._sum}
        self._sum.clear()
        self._count.clear()
        return out

    def state(self) -> dict:
        """The sums and counts since the last pop (a checkpoint between two log rows keeps them)."""
        return {"sum": dict(self._sum), "count": dict(self._count)}

    def load_state(self, state: dict) -> None:
        self._sum.clear()
        self._count.clear()
        self._sum.update({str(k): float(v) for k, v in state.get("sum", {}).items()})
        self._count.update({str(k): int(v) for k, v in state.get("count", {}).items()})


@dataclass(frozen=True)
class CompletionLimits:
    """How much of a step --log_completions writes beyond the text (completion_log.py): per-token data for at
    most ``max_tokens`` tokens of each of the first ``max_rows`` rows, and up to ``max_images`` thumbnails of
    at most ``thumbnail_px`` pixels a side on those rows."""

    max_tokens: int
    max_rows: int
    thumbnail_px: int = 128
    max_images: int = 4


def completion_limits(args) -> CompletionLimits | None:
    """The limits from the training options; None without --log_completions."""
    if not args.log_completions:
        return None
    return CompletionLimits(max_tokens=args.log_completions_max_tokens, max_rows=args.log_completions_max_rows)


SIGNIFICANT_DIGITS = 6


def round_significant(value: float, digits: int = SIGNIFICANT_DIGITS) -> float:
    """``value`` to ``digits`` significant digits (3e-7 stays 3e-7; rounding to decimals made it 0.0); NaN and
    infinities as they are."""
    if not math.isfinite(value) or value == 0:
        return value
    return float(f"{value:.{digits}g}")


def progress_postfix(logs: dict) -> dict:
    """What the progress bar shows after a logged step: reward and loss (and CHORD's mu and SFT loss)."""
    shown = {"reward": f"{logs.get('reward', math.nan):.3f}", "loss": f"{logs.get('loss', math.nan):.4f}"}
    if "mismatch/max_abs" in logs:  # the sampler-vs-trainer logprob gap (0 when they agree)
        shown["mismatch"] = f"{logs['mismatch/max_abs']:.2g}"
    if "chord/mu" in logs:
        shown.update(mu=f"{logs['chord/mu']:.3f}", sft_loss=f"{logs['chord/sft_loss']:.4f}")
    return shown


class JsonlLog:
    """An append-only JSON-lines file; on resume, lines after the checkpoint's step are dropped. The file stays
    open between writes (each line is flushed), so a step's log line is one write, not an open and a close."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path = path
        self.enabled = enabled
        self._file = None

    def write(self, row: dict) -> None:
        if self.enabled:
            with output_errors(self.path, "writing"):
                if self._file is None:
                    self._file = self.path.open("a", encoding="utf-8")
                self._file.write(jsonl_line(row, default=_jsonable))
                self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:  # the flush of a full disk; the write that failed has said so already
                pass

    def truncate_after(self, step: int) -> int:
        """Keep the rows of steps up to ``step`` (rewritten atomically). A last line that is not JSON (torn by a
        kill or a full disk) is dropped, not parsed; a bad line before it is an error naming the line. Returns
        the number of torn lines dropped."""
        self.close()
        if not (self.enabled and self.path.exists()):
            return 0
        lines = [line for line in self.path.read_bytes().split(b"\n") if line.strip()]
        kept, torn = [], 0
        for i, line in enumerate(lines):
            row = _parse_row(line)
            if row is None:
                if i < len(lines) - 1:
                    raise ConfigError(
                        f"{self.path}: line {i + 1} is not a JSON object (the file was edited or "
                        "damaged); repair or delete that line, then resume"
                    )
                torn += 1
                continue
            if row.get("step", 0) <= step:
                kept.append(line.decode("utf-8") + "\n")
        with output_errors(self.path, "rewriting"):
            atomic_write_text(self.path, "".join(kept))
        return torn

    def rows(self) -> list[dict]:
        """Every row that parses (a torn last line is not a row)."""
        if not self.path.exists():
            return []
        rows = (_parse_row(line) for line in self.path.read_bytes().split(b"\n") if line.strip())
        return [r for r in rows if r is not None]


# characters that json.dumps(ensure_ascii=False) leaves raw but str.splitlines() (and so many JSONL readers)
# takes for a line end; a model writes them (the byte-level BPE of a tiny random model does, from time to time)
_ESCAPE_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def jsonl_line(row: dict, default: Callable[[Any], Any] | None = None) -> str:
    """One JSON-lines row, text kept readable (not ``\\u`` escaped), ending in its only line break. Outside ASCII
    only U+0085, U+2028 and U+2029 are escaped: left raw, ``str.splitlines()`` splits the row in two."""
    return json.dumps(row, ensure_ascii=False, default=default).translate(_ESCAPE_LINE_BREAKS) + "\n"


def _parse_row(line: bytes) -> dict | None:
    try:
        row = json.loads(line)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    return row if isinstance(row, dict) else None


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


PLOTS = {
    "reward.png": ("reward", "reward (mean over completions)"),
    "kl.png": ("kl", "KL(policy ‖ ref)"),
    "completion_length.png": ("completions/mean_length", "completion length (tokens)"),
    "loss.png": ("loss", "loss"),
}


def plot_curves(rows: list[dict], out_dir: Path) -> list[Path]:
    """PNG plots of the main curves; skipped quietly for metrics that were never logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, (key, title) in PLOTS.items():
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(*zip(*pts), marker="o" if len(pts) < 40 else None)
        ax.set_xlabel("optimizer step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def summary_text(rows: list[dict], output_dir: Path, extra: dict[str, str], evals: list[dict] = ()) -> str:
    """The run's last lines: steps, reward first → last, where things are, then the held-out greedy score of each
    reward at the first and the last evaluation (``evals``: the eval rows of logging.jsonl)."""
    lines = [f"done: {rows[-1]['step'] if rows else 0} optimizer steps; everything is in {output_dir}/"]
    rewards = [r["reward"] for r in rows if "reward" in r]
    if rewards:
        k = max(1, len(rewards) // 5)
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        lines.append(f"  reward: {first:.3f} (first {k} step(s)) → {last:.3f} (last {k} step(s))")
    for key, value in extra.items():
        lines.append(f"  {key}: {value}")
    return "\n".join(lines + held_out_lines(evals))


def held_out_lines(evals: list[dict]) -> list[str]:
    """``held-out accuracy (greedy): 0.400 at step 0 → 0.860 at step 24``, one per reward; one evaluation alone
    gives its score."""
    if not evals:
        return []
    first, last = evals[0], evals[-1]
    out = []
    for key in (k for k in last if k.startswith("eval/") and k.endswith("/greedy")):
        name = key[len("eval/") : -len("/greedy")]
        after = f"{last[key]:.3f} at step {last['step']}"
        before = f"{first[key]:.3f} at step {first['step']} → " if first is not last and key in first else ""
        out.append(f"held-out {name} (greedy): {before}{after}")
    return out
