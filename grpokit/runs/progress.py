"""What a run shows while it trains: a tqdm bar on a terminal, plain lines elsewhere, moving in every long phase.

The loop and the window producer name the phase they enter (``Phases.set``: rollout, reward, logps, train); a
heartbeat thread ticks the bar once a second, so a first rollout of minutes is not a frozen ``0/24 [00:00<?]``:
the bar redraws with the phase and its seconds, and without a terminal a plain line is written when the first
phase starts and then whenever ``interval_s`` has passed without one, whether or not a step ended.

The estimate (s/step, ETA) is measured from the start of the second window on: the first window carries the
model's warm-up and the first rollout, which are not the rate of the rest. It is shown once a window after the
first has ended (a step ended, without phases) or at the last step; until then a line shows the elapsed time only.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

PROGRESS_INTERVAL_S = 30.0  # without a terminal: a line at least this often, in a phase or at a step's end
TICK_S = 1.0  # the heartbeat's period: the bar redraws (or a plain line is considered) this often
WINDOW_PHASES = ("rollout", "reward", "logps")  # entering one of these after a step has ended starts a window


class Phases:
    """The loop's current phase and since when. Set from the loop's thread; a background producer's calls (an
    asynchronous rollout runs beside training) are ignored, so the bar says what the loop waits for."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.name: str | None = None
        self._clock = clock
        self.since = clock()
        self.owner: int | None = None  # the loop's thread, once a bar is attached
        self.on_change: Callable[[str, float], None] | None = None  # the bar's: (phase, now)

    def set(self, name: str) -> None:
        if self.owner is not None and threading.get_ident() != self.owner:
            return
        if name != self.name:
            self.name, self.since = name, self._clock()
            if self.on_change is not None:
                self.on_change(name, self.since)

    def attach(self, on_change: Callable[[str, float], None]) -> None:
        self.owner, self.on_change = threading.get_ident(), on_change


class StepRate:
    """Seconds per step between window starts, the first window left out."""

    def __init__(self) -> None:
        self.first: tuple[float, int] | None = None  # (time, steps done) when the second window began
        self.last: tuple[float, int] | None = None

    def mark(self, now: float, step: int) -> None:
        if self.last is not None and step <= self.last[1]:
            return  # the same window (dynamic sampling rolls out again) or no step yet
        if self.first is None:
            self.first = (now, step)
        self.last = (now, step)

    def per_step(self) -> float | None:
        if self.first is None or self.last is None or self.last[1] == self.first[1]:
            return None
        return (self.last[0] - self.first[0]) / (self.last[1] - self.first[1])


class _Reporter:
    """What both kinds of progress share: the step count, the last logged values, the phase, the rate."""

    def __init__(self, total: int, initial: int, phases: Phases | None, clock: Callable[[], float]) -> None:
        self.total, self.n, self._start_n = total, initial, initial
        self.leave = True  # the loop sets False on an error: no closing line then
        self._clock = clock
        self._start = clock()
        self._postfix: dict[str, str] = {}
        self.rate = StepRate()
        self.phases = phases
        self._phased = False  # a phase was ever set: window starts mark the rate, not step ends
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the heartbeat's tick and the loop's update take turns
        if phases is not None:
            phases.attach(self._phase_changed)

    def _phase_changed(self, name: str, now: float) -> None:
        self._phased = True
        if name in WINDOW_PHASES and self.n > self._start_n:
            self.rate.mark(now, self.n)

    def set_postfix(self, **values: str) -> None:
        self._postfix = dict(values)

    def update(self, n: int = 1) -> None:
        self.n += n
        if not self._phased or self.n >= self.total:  # the last step ends the last window
            self.rate.mark(self._clock(), self.n)

    def phase_text(self, now: float) -> str | None:
        p = self.phases
        return None if p is None or p.name is None else f"{p.name} {duration(now - p.since)}"

    def start_heartbeat(self, period_s: float = TICK_S) -> None:
        def beat() -> None:
            while not self._stop.wait(period_s):
                self.tick()

        threading.Thread(target=beat, name="grpokit-progress", daemon=True).start()

    def tick(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stop.set()


class PlainProgress(_Reporter):
    """The progress bar's stand-in where a bar cannot be drawn (stderr is a file or a pipe) or is not wanted
    (``--disable_tqdm true``): one plain line for the first step, the last step, the first step after
    ``interval_s`` seconds without a line, and (``tick``) when the first phase starts and whenever ``interval_s``
    passes without a line inside a phase. Same calls as the tqdm bar the loop uses."""

    def __init__(
        self,
        total: int,
        initial: int = 0,
        interval_s: float = PROGRESS_INTERVAL_S,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        phases: Phases | None = None,
    ) -> None:
        super().__init__(total, initial, phases, clock)
        self.interval_s = interval_s
        self._stream = stream if stream is not None else sys.stderr
        self._last_line: float | None = None
        self._reported = initial

    def update(self, n: int = 1) -> None:
        with self._lock:
            super().update(n)
            now = self._clock()
            first = self._reported == self._start_n
            if first or self.n >= self.total or now - (self._last_line or self._start) >= self.interval_s:
                self._write(now)

    def tick(self) -> None:
        """A line in a long phase: at its start when nothing was written yet, then every ``interval_s`` (less
        two of the heartbeat's periods, so that a late tick still keeps every gap within ``interval_s``)."""
        with self._lock:
            now = self._clock()
            phase = self.phase_text(now)
            if phase is not None and (self._last_line is None or now - self._last_line >= self.interval_s - 2 * TICK_S):
                self._write(now, phase)

    def close(self) -> None:
        super().close()
        with self._lock:
            if self.leave and self._reported != self.n:
                self._write(self._clock())

    def _write(self, now: float, phase: str | None = None) -> None:
        self._last_line, self._reported = now, self.n
        line = progress_line(self.n, self.total, now - self._start, self._postfix, self.rate.per_step(), phase)
        print(line, file=self._stream, flush=True)


class TerminalProgress(_Reporter):
    """A tqdm bar whose text is ours: the phase and its seconds (redrawn each ``tick``), the last logged values,
    and the estimate of ``StepRate`` (tqdm's own would count the first window's warm-up as the rate)."""

    def __init__(self, total: int, initial: int, phases: Phases | None, disable: bool = False) -> None:
        super().__init__(total, initial, phases, time.monotonic)
        from tqdm.auto import tqdm  # not at the top: only a run on a terminal draws a bar

        self.bar = tqdm(
            total=total,
            initial=initial,
            desc="train",
            unit="step",
            disable=disable,
            dynamic_ncols=True,
            bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {elapsed}{postfix}",
        )
        self.disable = disable

    def set_postfix(self, **values: str) -> None:
        super().set_postfix(**values)
        self._redraw()

    def update(self, n: int = 1) -> None:
        with self._lock:
            super().update(n)
            self.bar.update(n)
        self._redraw()

    def tick(self) -> None:
        self._redraw()

    def _redraw(self) -> None:
        if self.disable or self._stop.is_set():
            return
        with self._lock:
            self._draw(self._clock())

    def _draw(self, now: float) -> None:
        parts = [p for p in (self.phase_text(now),) if p] + [f"{k} {v}" for k, v in self._postfix.items()]
        per_step = self.rate.per_step()
        if per_step is not None:
            parts.append(f"{_rate(per_step)}, ETA {duration(per_step * max(self.total - self.n, 0))}")
        self.bar.set_postfix_str(" | ".join(parts), refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        super().close()
        with self._lock:
            self.bar.leave = self.leave
            self.bar.close()


def progress_line(
    step: int, total: int, elapsed: float, postfix: dict[str, str], per_step: float | None, phase: str | None = None
) -> str:
    """`train: step 40/200 (20%) | rollout 12s | reward 0.412 | loss 0.0113 | 2m05s elapsed, 3.13 s/step, ETA
    8m21s` (the phase in a line written inside one, the estimate once there is one)."""
    parts = [f"train: step {step}/{total} ({100 * step // max(total, 1)}%)"]
    parts += [phase] if phase else []
    parts += [f"{key} {value}" for key, value in postfix.items()]
    timing = f"{duration(elapsed)} elapsed"
    if per_step is not None:
        timing += f", {_rate(per_step)}, ETA {duration(per_step * max(total - step, 0))}"
    return " | ".join(parts + [timing])


def _rate(per_step: float) -> str:
    return f"{per_step:.2f} s/step" if per_step >= 1 or per_step <= 0 else f"{1 / per_step:.2f} steps/s"


def duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h{m:02d}m{sec:02d}s" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def progress_bar(*, main: bool, disable_tqdm: bool, total: int, initial: int, phases: Phases | None = None):
    """A bar on a terminal; plain lines (``PlainProgress``) when stderr is not one or with --disable_tqdm true;
    nothing on the other processes. The main process's ticks once a second (the heartbeat)."""
    if main and (disable_tqdm or not sys.stderr.isatty()):
        bar = PlainProgress(total, initial, PROGRESS_INTERVAL_S, phases=phases)
    else:
        bar = TerminalProgress(total, initial, phases, disable=not main)
    if main:
        bar.start_heartbeat()
    return bar


class EvalProgress:
    """An evaluation's progress (``grpokit eval``/``infer``, a run's evaluation before and after training): plain
    lines to stderr, one when a pass starts, one when it ends, one after an engine call when ``interval_s`` has
    passed, and from the heartbeat at least every ``interval_s`` while a call runs. The estimate leaves the first
    engine call (the warm-up) out. Called as ``EvalSettings.progress``: ``(pass, prompts done, prompts)``."""

    def __init__(
        self,
        what: str = "eval",
        interval_s: float = PROGRESS_INTERVAL_S,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.interval_s, self._clock = what, interval_s, clock
        self._stream = stream if stream is not None else sys.stderr
        self._pass: tuple[str, int, int] | None = None  # (label, done, total) of the pass running
        self._start = self._last_line = clock()
        self.rate = StepRate()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def __call__(self, label: str, done: int, total: int) -> None:
        with self._lock:
            now = self._clock()
            new = self._pass is None or self._pass[0] != label or done < self._pass[1]
            if new:
                self._start, self.rate = now, StepRate()
            self._pass = (label, done, total)
            if done > 0:
                self.rate.mark(now, done)
            if new or done >= total or now - self._last_line >= self.interval_s - 2 * TICK_S:
                self._write(now)

    def tick(self) -> None:
        with self._lock:
            now = self._clock()
            if self._pass is not None and self._pass[1] < self._pass[2]:
                if now - self._last_line >= self.interval_s - 2 * TICK_S:
                    self._write(now)

    def _write(self, now: float) -> None:
        label, done, total = self._pass
        self._last_line = now
        line = f"{self.what}: {label} {done}/{total} prompts ({100 * done // max(total, 1)}%)"
        line += f" | {duration(now - self._start)} elapsed"
        per_prompt = self.rate.per_step()
        if per_prompt is not None and done < total:
            line += f", ETA {duration(per_prompt * (total - done))}"
        print(line, file=self._stream, flush=True)

    def __enter__(self) -> EvalProgress:
        def beat() -> None:
            while not self._stop.wait(TICK_S):
                self.tick()

        threading.Thread(target=beat, name="grpokit-eval-progress", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
