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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_thread_loops = threading.local()


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion and return its result (see the module docstring for where it runs)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop = getattr(_thread_loops, "loop", None)
        if loop is None or loop.is_closed():
            loop = _thread_loops.loop = asyncio.new_event_loop()
        return loop.run_until_complete(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpokit-run-sync") as pool:
        return pool.submit(run_sync, coro).result()


class LoopThread:
    """One asyncio event loop running forever in a daemon thread; ``submit`` returns a concurrent future."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
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
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()
