"""Killable helper processes for user code: started clean, killed with all they started.

``start(target, args, name)`` starts ``target(conn, *args)`` in a fresh interpreter (``python -c BOOT``: it
imports only what unpickling ``target`` and its arguments needs, never the trainer's ``__main__``) and returns it
with the parent's end of a duplex pipe; ``fork=True`` forks the caller instead, for what cannot be pickled. The
target should call ``detach()`` first: its own process group, Ctrl-C left to the trainer. ``kill(proc, conn)``
kills the process, its process group and every descendant (a subprocess in a session of its own too, a sandbox),
and waits for it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

from grpokit.rewards.descendants import descendants

BOOT = (
    "import pickle,sys;from multiprocessing.connection import Connection;c=Connection(int(sys.argv[1]));"
    "sys.path[:]=pickle.loads(c.recv_bytes());t,a=pickle.loads(c.recv_bytes());t(c,*a)"
)


class Child(subprocess.Popen):
    """A started helper: ``subprocess.Popen`` with the few names of ``multiprocessing.Process`` used here."""

    def is_alive(self) -> bool:
        return self.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(timeout)

    @property
    def exitcode(self) -> int | None:
        return self.poll()


def start(target: Any, args: tuple, name: str, fork: bool = False) -> tuple[Any, Any]:
    if fork:
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
        proc.start()
        child.close()
        return proc, parent
    parent, child = multiprocessing.Pipe()
    try:
        proc = Child([sys.executable, "-c", BOOT, str(child.fileno()), name], pass_fds=[child.fileno()],
                     stdin=subprocess.DEVNULL)  # fmt: skip
    finally:
        child.close()
    parent.send_bytes(pickle.dumps(list(sys.path)))
    parent.send_bytes(pickle.dumps((target, args)))
    return proc, parent


def detach() -> None:
    """In the started process: a process group of its own (so that ``kill`` reaches what it starts), and Ctrl-C,
    which the terminal sends to the trainer's whole group, left to the trainer."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def kill(proc: Any, conn: Connection | None) -> None:
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
