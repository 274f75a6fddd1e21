"""Processes that rewards and agents start do not outlive the run: ``reap_descendants()`` around a run.

At the start the trainer becomes a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``): a process that a reward
or an agent starts and abandons (``Popen("server &", shell=True)``, a double fork, a ``setsid`` daemon) is
re-parented to the trainer instead of to init, so it stays a descendant. At the end every descendant that was not
there at the start is killed (SIGKILL, in rounds until none is left, as killing a parent re-parents its children
to the trainer) and reaped. Processes that existed before the run (a server a test or a script started) and
multiprocessing's own helpers (the forkserver, the resource tracker) are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37
_ROUNDS = 10


def _prctl(option: int, value: int | ctypes.c_int) -> int:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        return -1


def _subreaper(on: bool | None = None) -> bool:
    """Whether this process is a child subreaper; ``on`` sets it first."""
    if on is not None:
        _prctl(_PR_SET_CHILD_SUBREAPER, int(on))
    flag = ctypes.c_int(0)
    return _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag)) == 0 and bool(flag.value)


def descendants(root: int | None = None) -> dict[int, str]:
    """Every live descendant of ``root`` (this process): pid -> its start time (to tell a reused pid apart)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if len(fields) > 19 and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append((int(entry), fields[19]))
    found: dict[int, str] = {}
    todo = [os.getpid() if root is None else root]
    while todo:
        for pid, started in children.get(todo.pop(), []):
            if pid not in found:
                found[pid] = started
                todo.append(pid)
    return found


def _helpers() -> set[int]:
    """multiprocessing's forkserver and resource tracker: shared helpers of the process, not the run's."""
    pids = set()
    try:
        from multiprocessing import forkserver, resource_tracker  # noqa: PLC0415 - stdlib, read only here

        pids.add(getattr(forkserver._forkserver, "_forkserver_pid", None))
        pids.add(getattr(resource_tracker._resource_tracker, "_pid", None))
    except (ImportError, AttributeError):
        pass
    return {p for p in pids if isinstance(p, int)}


def kill_new(before: dict[int, str]) -> int:
    """Kill (and reap) every descendant not in ``before``; returns how many were killed."""
    killed = 0
    for _ in range(_ROUNDS):
        spare = _helpers()
        new = [p for p, t in descendants().items() if before.get(p) != t and p not in spare]
        if not new:
            break
        for pid in new:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        for pid in new:
            try:
                os.waitpid(pid, 0)  # ours (a child, or re-parented to this subreaper): reap it
            except ChildProcessError:
                pass  # a grandchild: its parent reaps it, or it comes back to us in the next round
    return killed


@contextmanager
def reap_descendants() -> Iterator[None]:
    """Around a run: adopt orphaned descendants while it runs, kill the new ones when it ends."""
    before = descendants()
    was = _subreaper()
    _subreaper(True)
    try:
        yield
    finally:
        killed = kill_new(before)
        if killed:
            logger.warning("killed %d process(es) that rewards or agents started and left running", killed)
        if not was:
            _subreaper(False)
