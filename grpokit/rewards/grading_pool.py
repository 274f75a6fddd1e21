"""Grading runs in grader processes, never in the trainer: ``GraderPool`` keeps up to ``size`` of them.

A sample is sent whole (its completion, its tests, the limits, its deadline) to an idle grader process, which
starts the sandbox, runs the tests against the program's answers (``grader.py``) or compares the stdin cases'
outputs, and sends back the score. Whatever the program returns (huge values, colliding hashes, big-integer
arithmetic, text for a regex) is handled there: the trainer only waits on a pipe, holding no lock a grader
could keep. A grader that has not answered ``GRACE_S`` after the sample's deadline is killed with its sandbox
(``processes.kill``) and the sample scores 0 as a timeout; a fresh grader takes its place on the next sample.
Each grader's heap is bounded (``RLIMIT_DATA``: what it holds at start plus ``DATA_BUDGET``), so a value the
program sizes fails its test with a MemoryError there instead of taking the trainer's memory.
"""

from __future__ import annotations

import functools
import pickle
import queue
import resource
import time
from collections import Counter
from typing import Any

from grpokit.rewards import processes

GRACE_S = 2.0  # past a sample's deadline, how long its grader may take to answer (the sandbox's reaping, a fork)
START_S = 120.0  # a new grader that is not ready by then (an import that hangs) is killed; its sample scores 0
DATA_BUDGET = 1 << 30  # heap a grader process may add to what it holds at start


class GraderPool:
    """Grader processes, started on demand, reused, and replaced when one is killed."""

    def __init__(self, size: int, score: Any = None, serve: Any = None) -> None:
        """``score(completion, cases, limits, runtime, deadline)`` grades one sample in a grader process (code_exec's
        ``score_sample``); ``serve(conn)`` replaces the whole process loop (tests). Both module-level functions: a
        grader process is sent them by name."""
        self.size = size
        self.serve = serve or functools.partial(_serve, score=score)
        self._idle: queue.SimpleQueue = queue.SimpleQueue()

    def grade(self, completion: str, cases: Any, limits: Any, runtime: Any, budget_s: float) -> tuple[float, Counter]:
        """The sample's (score, failure counts), decided in a grader process within ``budget_s`` seconds from when
        that process is ready (+ GRACE_S)."""
        proc, conn = self._take()
        try:
            if not conn.poll(START_S) or conn.recv() != "ready":  # start-up is no part of the sample's budget
                raise EOFError
            deadline = time.monotonic() + budget_s
            conn.send_bytes(pickle.dumps((completion, cases, limits, runtime, deadline)))
            if conn.poll(max(0.0, deadline + GRACE_S - time.monotonic())):
                score, failures = conn.recv()
                self._idle.put((proc, conn))
                return score, Counter(failures)
            why = "timeout"
        except (EOFError, OSError, pickle.PickleError):  # the grader died (its memory bound, a signal)
            why = "error"
        except BaseException:
            processes.kill(proc, conn)
            raise
        processes.kill(proc, conn)
        return 0.0, Counter({why: 1})

    def _take(self) -> tuple[Any, Any]:
        """An idle grader that is still alive (the run's end may have killed them), else a new one."""
        while True:
            try:
                proc, conn = self._idle.get_nowait()
            except queue.Empty:
                return processes.start(self.serve, (), "grpokit-grader")
            if proc.is_alive():
                return proc, conn
            processes.kill(proc, conn)

    def close(self) -> None:
        while True:
            try:
                processes.kill(*self._idle.get_nowait())
            except queue.Empty:
                return


def _data_in_use() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) << 10
    return 0


def _serve(conn: Any, score: Any) -> None:
    """A grader process: one sample in, its score out, until the pipe closes."""
    processes.detach()
    limit = _data_in_use() + DATA_BUDGET
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    while True:
        conn.send("ready")
        try:
            completion, cases, limits, runtime, deadline = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the pool closed its end
            return
        value, failures = score(completion, cases, limits, runtime, deadline)
        conn.send((value, dict(failures)))
