"""Waiting on a reward with a deadline and a heartbeat: the pieces ``RewardRunner`` uses for ``--reward_timeout``.

``watch`` blocks until something is done, logging "reward X still running after N s" every ``heartbeat_s`` and
raising ``DeadlinePassed`` past a deadline. ``call_in_worker`` runs a sync call in a daemon thread and waits on it
that way (a thread cannot be killed: one past its deadline is left behind, and the caller stops training);
without a deadline the runner's ``Heartbeat`` runs it on the caller's thread, with one long-lived watcher thread
that only logs. ``Raised`` carries what a coroutine raised back to the caller as a value (a ``SystemExit`` raised
inside a task would otherwise stop the event loop's thread itself).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

logger = logging.getLogger("grpokit.rewards.runner")  # the runner's lines, under the runner's name

HEARTBEAT_S = 30.0  # a "still running" line this often while a reward is slow


class DeadlinePassed(Exception):
    """A reward ran past its deadline (the runner turns it into a RewardError naming it)."""


class Raised:
    """What a coroutine on the loop thread raised, carried back to the caller as a value."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Outcome:
    """What a worker thread's call returned or raised (any BaseException, re-raised on the caller's thread)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self, call: Callable[[], Any]) -> None:
        try:
            self.value = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which decides
            self.error = exc
        finally:
            self.done.set()

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


def watch(
    is_done: Callable[[], bool],
    running: Callable[[], list[str]],
    started: float,
    heartbeat_s: float,
    deadline: float | None = None,
    wait: Callable[[float], Any] | None = None,
) -> None:
    """Block until ``is_done()``, logging a heartbeat for each name of ``running()`` every ``heartbeat_s``;
    DeadlinePassed past ``deadline``. ``wait(seconds)`` blocks up to that long (a future's result, an event's
    wait); a future's own exception ends the watch (the caller reads it)."""
    next_beat = started + heartbeat_s
    while not is_done():
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise DeadlinePassed
        if now >= next_beat:
            for name in running():
                logger.warning("reward %r still running after %.1f s", name, now - started)
            next_beat += heartbeat_s
        until = next_beat if deadline is None else min(next_beat, deadline)
        try:
            wait(max(0.0, until - now)) if wait is not None else time.sleep(max(0.0, until - now))
        except (FutureTimeout, FutureCancelled, asyncio.TimeoutError):
            pass
        except BaseException:  # the future's own exception: it is done, the caller reads it
            if is_done():
                return
            raise


def call_in_worker(call: Callable[[], Any], name: str, timeout: float, heartbeat_s: float) -> Any:
    """``call()`` in a daemon thread, waited on for ``timeout`` seconds (DeadlinePassed after); what it raises
    is raised here."""
    started = time.monotonic()
    box = _Outcome()
    threading.Thread(target=box.run, args=(call,), name=f"grpokit-reward-{name}", daemon=True).start()
    watch(box.done.is_set, lambda: [name], started, heartbeat_s, started + timeout, box.done.wait)
    return box.result()
