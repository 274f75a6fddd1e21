"""What a run shows while it trains, as a process: without a terminal (nohup, a pipe, a CI log) plain lines, at
least one every 30 s even while the first rollout's rewards take longer than that; on a terminal a bar that moves
before the first step ends.

Both runs score with a reward (written below as a plugin) that, on its first call, waits until the test has seen
what it looks for (it creates ``GO``), at most ``MAX_WAIT_S``: the first rollout lasts as long as the test needs,
and the test never asserts a wall-clock time, only what the lines say.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import termios
import time
from pathlib import Path

import pytest
from cli_process import StartedGrpokit
from support import flags

pytestmark = pytest.mark.slow

MAX_WAIT_S = 90  # the plugin's own bound: a test that never releases it still ends
PLUGIN = f"""
import os, time
from grpokit.rewards import orms


def waits_once(completions, **kwargs):
    go = os.environ["GRPOKIT_TEST_GO"]
    if not os.path.exists(go + ".first"):
        open(go + ".first", "w").close()
        deadline = time.monotonic() + {MAX_WAIT_S}
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.2)
    return [0.0] * len(completions)


orms["waits_once"] = waits_once
"""


@pytest.fixture
def slow_run(tiny_model_dir, math_jsonl, tmp_path):
    """`grpokit train` args (2 steps of the tiny model, the waiting reward first) and the environment."""
    plugin = tmp_path / "waits_once.py"
    plugin.write_text(PLUGIN)
    args = flags(
        "train",
        {"--model": tiny_model_dir, "--dataset": math_jsonl, "--output_dir": tmp_path / "out"},
        "--num_generations 4 --per_device_train_batch_size 8 --max_completion_length 6 --max_steps 2 --beta 0",
        "--torch_dtype float32 --plots false --save_final_model false --tuner_type full",
        {"--external_plugins": plugin},
        "--reward_funcs waits_once accuracy",
    )
    go = tmp_path / "GO"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPOKIT_TEST_GO": str(go)}
    return args, env, go


def _wait_for(read, pattern: str, proc, seconds: float = MAX_WAIT_S + 60) -> re.Match:
    """The first match of ``pattern`` in what ``read()`` returns as the run goes on."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        m = re.search(pattern, read())
        if m is not None:
            return m
        assert proc.poll() is None, f"the run ended before {pattern!r}:\n{read()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in:\n{read()[-3000:]}")


def _elapsed(line: str) -> int:
    m = re.search(r"\| (?:(\d+)m)?(\d+)s elapsed", line)
    return int(m.group(1) or 0) * 60 + int(m.group(2))


def test_without_a_terminal_a_line_at_least_every_30_s_even_inside_the_first_rollout(slow_run, tmp_path):
    args, env, go = slow_run
    err = tmp_path / "stderr.txt"
    proc = StartedGrpokit(args, env, output=str(err))  # stdout and stderr: one file, not a terminal
    # a line when the first phase started, then one while the first rollout's rewards have been running ~30 s
    _wait_for(err.read_text, r"train: step 0/2 \(0%\) \| \w+ \d+s \|[^\n]*\ntrain: step 0/2 \(0%\) \| reward", proc)
    go.touch()
    assert proc.wait(timeout=240) == 0, err.read_text()[-3000:]
    text = err.read_text()
    lines = [line for line in text.splitlines() if line.startswith("train: step")]
    # a line when the first rollout starts, then within every 30 s while its rewards run, then the steps
    assert re.fullmatch(r"train: step 0/2 \(0%\) \| (rollout|reward) \d+s \| \d+s elapsed", lines[0]), lines
    waiting = [line for line in lines if line.startswith("train: step 0/2 (0%) | reward")]
    assert waiting and all(_elapsed(b) - _elapsed(a) <= 30 for a, b in zip(lines, lines[1:])), lines
    steps = [int(re.match(r"train: step (\d+)/2 ", line).group(1)) for line in lines]
    assert steps[-2:] == [1, 2] and set(steps[:-2]) == {0}, lines
    # the last step's line: logged values and an estimate measured after the first window
    assert re.fullmatch(
        r"train: step 2/2 \(100%\) \| reward \d\.\d{3} \| loss -?\d\.\d{4} \| \d+s elapsed, "
        r"\d+\.\d\d (s/step|steps/s), ETA 0s",
        lines[-1],
    ), lines[-1]
    assert "\r" not in text  # no bar drawn into the file
    assert text.index("batch plan:") < text.index("done: 2 optimizer steps")


def test_on_a_terminal_the_bar_moves_before_the_first_step_ends(slow_run):
    args, env, go = slow_run
    master, slave = pty.openpty()
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    os.set_blocking(master, False)
    seen = bytearray()

    def read() -> str:
        try:
            while chunk := os.read(master, 65536):
                seen.extend(chunk)
        except (BlockingIOError, OSError):
            pass
        return seen.decode("utf-8", "replace")

    try:
        proc = StartedGrpokit(args, env, output=os.ttyname(slave))
        # two drawings of the bar at 0/2 in the rewards' phase, a second apart: it moves while nothing ends
        _wait_for(read, r"train: 0/2 \|[^\r\n]*reward [1-9]\d*s", proc)
        first = _wait_for(read, r"train: 0/2 \|[^\r\n]*reward (\d+)s", proc).group(1)
        _wait_for(read, rf"train: 0/2 \|[^\r\n]*reward (?!{first}s)\d+s", proc)
        go.touch()
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            read()  # a full terminal would block the run's writes
            time.sleep(0.1)
        read()
    finally:
        os.close(slave)
        os.close(master)
    text = seen.decode("utf-8", "replace")
    assert proc.returncode == 0, text[-3000:]
    frames = re.split(r"[\r\n]", text)
    first_step = next(i for i, f in enumerate(frames) if "train: 1/2" in f)
    before = {f.strip() for f in frames[:first_step] if f.startswith("train: 0/2")}
    assert len(before) >= 2, before  # the bar was redrawn with new text before step 1 ended
    assert any("train: 2/2" in f for f in frames)
    assert Path(args[args.index("--output_dir") + 1], "logging.jsonl").is_file()
