"""--async_generate: the next window's rollout in a background thread while the loop trains on this one."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: the producer is handed in
    from grpokit.trainers.window import WindowRollout
    from grpokit.trainers.window_producer import WindowProducer


class AsyncWindows:
    """--async_generate: the rollout of the window after the current one runs in a background thread while the
    loop trains on the current one (it samples from weights one window old)."""

    def __init__(self, producer: WindowProducer) -> None:
        self._producer = producer
        self._executor: ThreadPoolExecutor | None = None
        self._pending: tuple[Future, list[dict], int] | None = None  # (future, prompts, step submitted)

    @property
    def in_flight(self) -> bool:
        """A rollout was started whose prompts are not trained on yet."""
        return self._pending is not None

    def next(self, step: int) -> tuple[list[dict], WindowRollout, dict[str, float]]:
        """The prompts and rollout of the next window, and the async metrics; starts the one after it."""
        if self._pending is None:
            self._pending = self._submit(step)
        future, prompts, submitted_at = self._pending
        t0 = time.perf_counter()
        rollout = future.result()
        wait = time.perf_counter() - t0
        self._pending = self._submit(step)
        return prompts, rollout, {"async/staleness": step - submitted_at, "async/wait_s": wait,
                                  "async/time_saved_s": max(0.0, rollout.timing["rollout"] - wait)}

    def _submit(self, step: int) -> tuple[Future, list[dict], int]:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpokit-rollout")
        prompts = self._producer.prompts.next()
        return self._executor.submit(self._producer.rollout, prompts), prompts, step

    def drain(self) -> None:
        """Wait for a rollout still in flight (its prompts were never trained on; a checkpoint does not count
        them as consumed)."""
        if self._pending is not None:
            self._pending[0].exception()  # wait; an error there no longer matters
            self._pending = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
