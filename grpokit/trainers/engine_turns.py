"""Who drives the rollout engine. The loop's own rollout (the synchronous loop's window, a dynamic-sampling
round) has the engine to itself; the calls of the buffer of asynchronous training share it, any number at once
(one engine batches the requests that arrive together). A rollout of the loop waits for the buffer's calls
running to end, and holds back new ones meanwhile, so that the two never drive the engine at the same time."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

POLL_S = 0.005  # how often a call waiting for its turn looks again


class EngineTurns:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shared = 0  # the buffer's calls driving the engine now
        self._exclusive = False
        self._waiting = 0  # the loop's rollouts waiting: no new shared call starts before them

    @asynccontextmanager
    async def hold(self, *, exclusive: bool) -> AsyncIterator[None]:
        """The engine for one rollout call: to itself (``exclusive``, the loop's) or shared (the buffer's)."""
        if exclusive:
            with self._lock:
                self._waiting += 1
        try:
            while not self._try(exclusive):
                await asyncio.sleep(POLL_S)
        finally:
            if exclusive:
                with self._lock:
                    self._waiting -= 1
        try:
            yield
        finally:
            with self._lock:
                if exclusive:
                    self._exclusive = False
                else:
                    self._shared -= 1

    def _try(self, exclusive: bool) -> bool:
        with self._lock:
            if self._exclusive or (exclusive and self._shared) or (not exclusive and self._waiting):
                return False
            if exclusive:
                self._exclusive = True
            else:
                self._shared += 1
            return True
