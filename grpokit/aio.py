"""How grpokit runs async work from sync code: the one place that decides, and why.

The training loop is synchronous; three parts of it await coroutines: the rollout scheduler (trajectories run
as coroutines so that many multi-turn trajectories share engine batches), the rollout client (HTTP calls to
several servers at once) and the reward runner (async rewards awaited together). Two tools cover all three:

- ``run_sync(coro)`` runs a coroutine to completion on an event loop kept per calling thread. The loop stays on
  the caller's thread because the in-process engine samples there (``InferEngine.infer_on_loop_thread``) and
  because the caller is blocked anyway. A loop is made once per thread rather than by ``asyncio.run`` per call:
  ``asyncio.run`` creates and closes a loop each time and, on the main thread, swaps the SIGINT handler around
  every call. Called from inside a running event loop (an async plugin calling a sync API), the coroutine runs
  on a fresh thread's loop instead, since a loop cannot be re-entered.
- ``LoopThread`` is an event loop running in a daemon thread, for work that must proceed *while* the caller does
  something else: the reward runner awaits the async rewards there while the sync rewards run on the caller's
  thread.

Stopping: when ``run_sync`` is left by an exception (Ctrl-C lands in whichever task is running, a reward raises),
the tasks still pending on its loop are cancelled and awaited, and every task's exception is collected, so that
nothing prints "Task was destroyed but it is pending" or "exception was never retrieved" tracebacks later.
``cancel_background_work()`` cancels what the loops of other threads are running (the --async_generate
rollout thread, a reward loop), so that a run that stops does not wait for a rollout nobody will train on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_thread_loops = threading.local()
_all_loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()  # for cancel_background_work
DRAIN_TIMEOUT_S = 10.0  # how long cancelled tasks get to finish their clean-up


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion and return its result (see the module docstring for where it runs)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop = getattr(_thread_loops, "loop", None)
        if loop is None or loop.is_closed():
            loop = _thread_loops.loop = asyncio.new_event_loop()
            _all_loops.add(loop)
        return _run_until_complete(loop, coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpokit-run-sync") as pool:
        return pool.submit(run_sync, coro).result()


def _run_until_complete(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    tracked: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()
    factory = loop.get_task_factory()

    def track(loop_, c, **kwargs):  # every task this call starts, to collect its outcome if it is left early
        task = factory(loop_, c, **kwargs) if factory else asyncio.Task(c, loop=loop_, **kwargs)
        tracked.add(task)
        return task

    loop.set_task_factory(track)
    try:
        main = loop.create_task(coro)
        return loop.run_until_complete(main)
    except BaseException:
        _cancel_and_drain(loop, list(tracked))
        raise
    finally:
        loop.set_task_factory(factory)


def _cancel_and_drain(loop: asyncio.AbstractEventLoop, tasks: list[asyncio.Task]) -> None:
    """Cancel the pending tasks, let them run their clean-up (bounded), and collect every task's outcome."""
    pending = [t for t in tasks if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        with contextlib.suppress(BaseException):  # a second Ctrl-C while draining: stop draining
            loop.run_until_complete(asyncio.wait(pending, timeout=DRAIN_TIMEOUT_S))
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" report when it is collected


def cancel_background_work() -> None:
    """Cancel the tasks of every grpokit loop running on another thread (see the module docstring)."""
    try:
        mine = asyncio.get_running_loop()
    except RuntimeError:
        mine = None
    for loop in list(_all_loops):
        if loop.is_closed() or not loop.is_running() or loop is mine:
            continue
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            loop.call_soon_threadsafe(_cancel_all, loop)


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()


class LoopThread:
    """One asyncio event loop running forever in a daemon thread; ``submit`` returns a concurrent future."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        _all_loops.add(self.loop)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(_cancel_all, self.loop)  # nothing left pending when the loop closes
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()
