"""Progress without a terminal: plain lines from PlainProgress, on a clock the tests drive (no sleeping)."""

from __future__ import annotations

import io
import re
from types import SimpleNamespace

import pytest

from grpokit.runs.progress import EvalProgress, Phases, PlainProgress, progress_line


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run(total: int, seconds_per_step: float, steps: int, initial: int = 0, interval_s: float = 30.0):
    clock, out = FakeClock(), io.StringIO()
    bar = PlainProgress(total, initial, interval_s=interval_s, stream=out, clock=clock)
    for i in range(steps):
        clock.now += seconds_per_step
        bar.set_postfix(reward=f"{(initial + i + 1) / 10:.3f}", loss="0.0100")
        bar.update(1)
    return bar, clock, out


def _steps(out: io.StringIO) -> list[int]:
    return [int(re.match(r"train: step (\d+)/", line).group(1)) for line in out.getvalue().splitlines()]


def test_a_line_for_the_first_step_then_once_30_s_have_passed_then_the_last_step():
    _, _, out = _run(total=10, seconds_per_step=7.0, steps=10)
    # lines at 7 s (step 1), at 42 s (step 6: the first step 30 s or more after 7 s) and at the last step
    assert _steps(out) == [1, 6, 10]
    assert out.getvalue().splitlines()[1] == (
        "train: step 6/10 (60%) | reward 0.600 | loss 0.0100 | 42s elapsed, 7.00 s/step, ETA 28s"
    )


def test_steps_slower_than_the_interval_get_a_line_each():
    _, _, out = _run(total=4, seconds_per_step=45.0, steps=4)
    assert _steps(out) == [1, 2, 3, 4]


def test_the_interval_is_a_parameter():
    _, _, out = _run(total=100, seconds_per_step=1.0, steps=25, interval_s=10.0)
    assert _steps(out) == [1, 11, 21]


def test_close_reports_the_step_reached_unless_an_error_ended_the_run():
    bar, _, out = _run(total=100, seconds_per_step=1.0, steps=3)
    bar.close()
    assert _steps(out) == [1, 3]
    bar, _, out = _run(total=100, seconds_per_step=1.0, steps=3)
    bar.leave = False  # what the loop sets when an exception ends training
    bar.close()
    assert _steps(out) == [1]


def test_a_resumed_run_counts_its_rate_from_its_own_steps():
    _, _, out = _run(total=6, seconds_per_step=0.5, steps=2, initial=4)
    assert out.getvalue().splitlines() == [
        "train: step 5/6 (83%) | reward 0.500 | loss 0.0100 | 0s elapsed",  # no rate from a first step
        "train: step 6/6 (100%) | reward 0.600 | loss 0.0100 | 1s elapsed, 2.00 steps/s, ETA 0s",
    ]


def test_the_first_step_warm_up_is_not_the_rate():
    # step 1 takes 90 s (warm-up, the first rollout), the others 10 s each: the estimate uses 10 s, not 90 s
    clock, out = FakeClock(), io.StringIO()
    bar = PlainProgress(24, interval_s=30.0, stream=out, clock=clock)
    for seconds in (90.0, 10.0, 10.0, 10.0):
        clock.now += seconds
        bar.update(1)
    lines = out.getvalue().splitlines()
    assert lines[0] == "train: step 1/24 (4%) | 1m30s elapsed"
    assert lines[1] == "train: step 4/24 (16%) | 2m00s elapsed, 10.00 s/step, ETA 3m20s"


def _phased(interval_s: float = 30.0):
    clock, out, phases = FakeClock(), io.StringIO(), None
    phases = Phases(clock)
    bar = PlainProgress(10, interval_s=interval_s, stream=out, clock=clock, phases=phases)
    return bar, clock, out, phases


def test_a_line_when_the_first_phase_starts_then_one_every_interval_inside_a_long_phase():
    bar, clock, out, phases = _phased()
    bar.tick()
    assert out.getvalue() == ""  # no phase yet: nothing to say
    phases.set("rollout")
    clock.now += 1
    bar.tick()  # the heartbeat's first tick in the first phase
    clock.now += 20
    phases.set("reward")
    for _ in range(40):  # a reward that takes 40 s, the heartbeat ticking each second
        clock.now += 1
        bar.tick()
    assert out.getvalue().splitlines() == [
        "train: step 0/10 (0%) | rollout 1s | 1s elapsed",
        "train: step 0/10 (0%) | reward 8s | 29s elapsed",  # 28 s after the first: no gap reaches 30 s
        "train: step 0/10 (0%) | reward 36s | 57s elapsed",
    ]


def test_with_phases_the_rate_runs_from_the_second_window_start():
    bar, clock, out, phases = _phased(interval_s=1000.0)
    # window 1: 60 s of rollout (warm-up) + 2 steps; windows 2 and 3: 10 s of rollout + 2 steps of 5 s
    for rollout_s in (60.0, 10.0):
        phases.set("rollout")
        clock.now += rollout_s
        phases.set("train")
        for _ in range(2):
            clock.now += 5.0
            bar.update(1)
    assert bar.rate.per_step() is None  # window 2 has not ended: nothing measured yet
    phases.set("rollout")  # window 3 starts: window 2 took 20 s for 2 steps
    assert bar.rate.per_step() == 10.0
    phases.set("rollout")  # the same phase again (dynamic sampling's resampling): no new mark
    clock.now += 3
    phases.set("reward")
    assert bar.rate.per_step() == 10.0


def test_a_background_thread_does_not_move_the_phase():
    import threading

    bar, clock, out, phases = _phased()
    phases.set("train")
    t = threading.Thread(target=phases.set, args=("rollout",))  # --max_staleness: a rollout beside training
    t.start()
    t.join()
    assert phases.name == "train"


def test_an_evaluation_says_each_pass_and_beats_while_a_call_runs():
    clock, out = FakeClock(), io.StringIO()
    progress = EvalProgress(interval_s=30.0, stream=out, clock=clock)
    progress("greedy", 0, 300)  # the pass starts: a line
    for _ in range(50):  # the first call (warm-up) takes 50 s: the heartbeat speaks inside it
        clock.now += 1.0
        progress.tick()
    progress("greedy", 100, 300)  # 100 prompts done
    clock.now += 20.0
    progress("greedy", 200, 300)  # 20 s per 100 prompts from here: ETA 20 s, the warm-up left out
    clock.now += 20.0
    progress("greedy", 300, 300)
    progress("4 samples each", 0, 300)
    assert out.getvalue().splitlines() == [
        "eval: greedy 0/300 prompts (0%) | 0s elapsed",
        "eval: greedy 0/300 prompts (0%) | 28s elapsed",
        "eval: greedy 200/300 prompts (66%) | 1m10s elapsed, ETA 20s",  # 42 s after the last line
        "eval: greedy 300/300 prompts (100%) | 1m30s elapsed",
        "eval: 4 samples each 0/300 prompts (0%) | 0s elapsed",
    ]


def test_long_runs_show_minutes_and_hours():
    assert progress_line(10, 1000, 3725.0, {}, 372.5) == (
        "train: step 10/1000 (1%) | 1h02m05s elapsed, 372.50 s/step, ETA 102h26m15s"
    )


@pytest.mark.parametrize(
    "main, tty, disable_tqdm, expected",
    [
        (True, True, False, "bar"),
        (True, False, False, "lines"),  # a file, a pipe, nohup
        (True, True, True, "lines"),  # --disable_tqdm true: no bar, plain lines instead
        (False, False, False, "nothing"),  # only the main process reports
        (False, True, True, "nothing"),
    ],
)
def test_progress_kind_by_terminal_flag_and_process(monkeypatch, main, tty, disable_tqdm, expected):
    from grpokit.runs.progress import progress_bar

    monkeypatch.setattr("sys.stderr", SimpleNamespace(isatty=lambda: tty, write=lambda s: len(s), flush=lambda: None))
    bar = progress_bar(main=main, disable_tqdm=disable_tqdm, total=5, initial=0)
    kind = "lines" if isinstance(bar, PlainProgress) else ("nothing" if bar.disable else "bar")
    bar.close()
    assert kind == expected
