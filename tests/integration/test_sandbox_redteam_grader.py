"""Red team for the code_exec grader and bounds (issue 28), every result checked from outside the sandbox.

- grader: each hostile program of ``GRADER_TRICKS`` (forged verdicts, objects equal to everything, patched
  builtins, planted modules, expected values looked up through ``gc``, a thread answering the parent's calls,
  a patched harness, exits, huge and deep answers, format bombs) against every test style of ``GRADER_STYLES``,
  each beside a right answer: every wrong answer scores 0, every right one 1, the trainer's RSS stays bounded and
  nothing unescaped reaches its log;
- reports: integers of any length, right programs that need them;
- memory: SysV shared memory, memfds (also parked in a socket), pipes parked in a socket, message queues, empty
  directories and files, measured on the host in /proc/meminfo while they run;
- time: a wrong sample whose stdin cases each take most of the limit, and one whose calls do;
- logs and exit codes: a forged ``fatal`` report, exit codes that name other failures;
- isolation: inotify, ``flock`` on host files (checked by locking them from the host), a file planted in /etc.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import sys
import threading
import time
import uuid

import pytest
from sandbox_redteam_programs import (
    GRADER_STYLES,
    GRADER_TRICKS,
    ISOLATION28,
    LOGS_AND_EXITS,
    MEMORY,
    RIGHT28,
    SOLUTION,
    STDIN_MAIN,
    render,
)  # fmt: skip

from grpokit.rewards import isolation
from grpokit.rewards.code_exec import CodeExecReward
from grpokit.rewards.sandbox import SandboxLimits, live_sandbox_processes, run_job

try:
    isolation.resolve("bwrap")
    _MISSING = None
except OSError as exc:
    _MISSING = str(exc)
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))

TIMEOUT = 3  # code_exec_timeout here: slack for a busy host
RSS_GROWTH_MB = 200  # what one batch may add to the trainer's resident memory


@pytest.fixture(scope="module")
def reward():
    return CodeExecReward(code_exec_timeout=TIMEOUT, code_exec_memory_mb=256, code_exec_workers=4)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _program(code: str, style: str) -> str:
    code = render(code) + SOLUTION
    return code + STDIN_MAIN if style == "stdin_stdout" else code


def _clean_log(caplog) -> None:
    for rec in caplog.records:
        msg = rec.getMessage()
        assert "\x1b" not in msg and "\n" not in msg and "\r" not in msg and len(msg) < 2000, msg[:300]


@pytest.mark.parametrize("style", sorted(GRADER_STYLES))
def test_no_trick_passes_any_style(style, reward, caplog):
    caplog.set_level(logging.WARNING)
    tests = GRADER_STYLES[style]
    names = sorted(GRADER_TRICKS)
    completions, cases = [], []
    for name in names:
        completions += [_program(GRADER_TRICKS[name], style), _program(RIGHT28, style)]
        cases += [tests, tests]
    rss = _rss_mb()
    start = time.monotonic()
    scores = reward(completions, test_cases=cases)
    elapsed = time.monotonic() - start
    assert {n: s for n, s in zip(names, scores[0::2]) if s != 0.0} == {}, "a wrong answer scored above 0"
    assert scores[1::2] == [1.0] * len(names), "a right answer lost points beside a hostile one"
    assert _rss_mb() - rss < RSS_GROWTH_MB
    assert live_sandbox_processes() == []
    assert elapsed < 30 + 2 * len(names) * (TIMEOUT + 0.5) / 4
    _clean_log(caplog)


def test_integers_of_any_length(reward):
    tests = "from math import factorial\nassert f(2000) == factorial(2000)\nassert f(3) == 6"
    right = "import math, sys\nsys.set_int_max_str_digits(0)\ndef f(n):\n    return math.factorial(n)\n"
    plain = "import math\ndef f(n):\n    return math.factorial(n)\n"  # no digit limit raised: fine as well
    forged = "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'{\"q\": 1, \"v\": ' + " \
             "b'9' * 5000 + b'}\\n')\n    except OSError:\n        pass\ndef f(n):\n    return 0\n"  # fmt: skip
    huge = "import sys\nsys.set_int_max_str_digits(0)\ndef f(n):\n    return 10 ** 200000\n"
    assert reward([right, plain, forged, huge], test_cases=[tests] * 4) == [1.0, 1.0, 0.0, 0.0]


class MemInfo:
    """Host memory outside processes' address spaces (shared memory, kernel slab), sampled while a batch runs."""

    FIELDS = ("Shmem", "SUnreclaim")

    def __init__(self) -> None:
        self.base = self.read()
        self.peak = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @classmethod
    def read(cls) -> int:
        with open("/proc/meminfo") as f:
            vals = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)}
        return sum(vals.get(k, 0) for k in cls.FIELDS) * 1024

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.read() - self.base)
            time.sleep(0.02)

    def close(self) -> int:
        self.stop.set()
        self.thread.join()
        return self.peak


def test_memory_stays_within_the_limits(reward):
    names = sorted(MEMORY)
    progs = [render(MEMORY[n]) for n in names]
    stdio = [{"input": "", "output": "never"}]
    meter = MemInfo()
    with_out = {}
    for name, code in zip(names, progs):  # what each one says it held, one at a time
        with_out[name] = run_job(code, limits=SandboxLimits(timeout_s=TIMEOUT, memory_mb=256)).stdout
    scores = reward(progs + [RIGHT28 + "print(f(int(input())))"], test_cases=[stdio] * len(progs)
                    + [[{"input": "5", "output": "31"}]])  # fmt: skip
    peak = meter.close()
    held = {n: int(m.group(1)) for n, out in with_out.items() for m in [re.search(r"HELD (\d+)", out)] if m}
    assert set(held) == set(names), with_out
    assert {n: h for n, h in held.items() if h > 8 << 20} == {}, "memory held outside the limits"
    assert scores == [0.0] * len(progs) + [1.0]
    # 4 slots at once, each up to its 64 MiB tmpfs, plus what other work on this host does meanwhile
    assert peak < 4 * (80 << 20) + (300 << 20), f"host shared/slab memory grew by {peak >> 20} MiB"


def test_time_is_bounded_per_sample(reward):
    slow = "import time\ntime.sleep(%.1f)\nprint(0)" % (0.8 * TIMEOUT)
    start = time.monotonic()
    assert reward([slow], test_cases=[[{"input": str(i), "output": "1"} for i in range(10)]]) == [0.0]
    assert time.monotonic() - start < TIMEOUT + 0.5 + 1.5
    calls = "import time\ndef f(n):\n    time.sleep(%.1f)\n    return 0\n" % (0.4 * TIMEOUT)
    start = time.monotonic()
    assert reward([calls], test_cases=["\n".join(f"assert f({i}) == {i}" for i in range(1, 11))]) == [0.0]
    assert time.monotonic() - start < TIMEOUT + 0.5 + 1.5


def test_logs_and_failure_kinds_are_the_parents(reward, caplog):
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="grpokit")  # an earlier in-process run on this worker may have raised it
    names = sorted(LOGS_AND_EXITS)
    scores = reward([render(LOGS_AND_EXITS[n]) for n in names],
                    test_cases=[[{"input": "", "output": "x"}]] * len(names))  # fmt: skip
    assert scores == [0.0] * len(names)
    assert reward.last_failures["timeout"] == 0 and reward.last_failures["output_limit"] == 0
    assert reward.last_failures["memory"] == 0
    assert sum(reward.last_failures.values()) == len(names)
    _clean_log(caplog)
    # whether the forged 200 KB report reaches the parent whole depends on how the pipe is drained (it did alone and
    # not on a loaded xdist worker); when its hint is logged, it is one escaped line cut to its bound
    hints = [r.getMessage() for r in caplog.records if "could not lock the process down" in r.getMessage()]
    assert all(len(m) < 400 for m in hints), hints


def test_isolation_from_host_and_batch_mates(reward):
    secret = f"grpokit-etc-secret-{uuid.uuid4().hex}"
    planted = f"/etc/grpokit-rt-{uuid.uuid4().hex}"
    with open(planted, "w") as f:
        f.write(secret)
    os.chmod(planted, 0o644)
    try:
        out = {}
        t = threading.Thread(
            target=lambda: out.update(
                flock=run_job(render(ISOLATION28["flock_host_file"]), limits=SandboxLimits(timeout_s=TIMEOUT))
            )
        )
        t.start()
        time.sleep(0.8)  # the program holds its locks (if it got them) for 1.5 s
        with open(sys.executable, "rb") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError when the lock is held
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        t.join()
        assert "LOCKED" not in out["flock"].stdout and out["flock"].stdout.count("Operation not permitted") == 2
        notify = run_job(render(ISOLATION28["inotify_on_shared_paths"]), limits=SandboxLimits(timeout_s=TIMEOUT))
        assert "INOTIFY -1" in notify.stdout and "WATCH" not in notify.stdout, notify.stdout + notify.stderr
        etc = run_job(render(ISOLATION28["read_planted_etc_file"]), limits=SandboxLimits(timeout_s=TIMEOUT))
        assert etc.status == "ok" and secret not in etc.stdout
        assert sorted(line.split()[0] for line in etc.stdout.splitlines() if line and not line[0].isspace()) \
            <= sorted(os.path.basename(p) for p in isolation.ETC_FILES)  # fmt: skip
    finally:
        os.unlink(planted)


def test_the_memory_checks_see_escapes_without_isolation():
    """Control: without the sandbox a memfd does hold its memory, and both checks above see it."""
    meter = MemInfo()
    unsafe_run = run_job(render(MEMORY["memfd_929m"]).replace("range(58)", "range(12)"),
                         limits=SandboxLimits(timeout_s=TIMEOUT, memory_mb=256),
                         rt=isolation.resolve("none"))  # fmt: skip
    assert int(re.search(r"HELD (\d+)", unsafe_run.stdout).group(1)) == 192 << 20  # not in its address space
    assert meter.close() > 150 << 20
