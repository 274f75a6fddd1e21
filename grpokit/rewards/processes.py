"""Killable helper processes for user code: started through multiprocessing, killed with all they started.

``start(target, args, name)`` starts ``target(conn, *args)`` in a process of its own (through a ``forkserver``
that has imported grpokit's rewards once, so a start costs a fork; ``fork=True`` forks the caller instead, for
what cannot be pickled) and returns it with the parent's end of a pipe. The target should call ``detach()``
first: its own process group, Ctrl-C left to the trainer. ``kill(proc, conn)`` kills the process, its process
group and every descendant (a subprocess in a session of its own too, a sandbox), and waits for it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
from typing import Any

from grpokit.rewards.descendants import descendants

_PRELOAD = ["grpokit.rewards", "grpokit.rewards.worker", "grpokit.rewards.grading_pool"]


def start(target: Any, args: tuple, name: str, fork: bool = False) -> tuple[Any, Any]:
    if fork:
        ctx = multiprocessing.get_context("fork")
    else:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD + [m for m in ("torch", "numpy") if m in sys.modules])
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
    proc.start()
    child.close()
    return proc, parent


def detach() -> None:
    """In the started process: a process group of its own (so that ``kill`` reaches what it starts), and Ctrl-C,
    which the terminal sends to the trainer's whole group, left to the trainer."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def kill(proc: Any, conn: Any) -> None:
    if conn is not None:
        conn.close()
    if proc is None:
        return
    for pid in descendants(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for stop in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
            stop()
    proc.join(5)
