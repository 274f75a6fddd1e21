"""--max_staleness K: windows rolled out ahead by a background producer while the loop trains, each no more than K
optimizer steps older than the weights that train it.

Versions: a window is tagged with the weight version the engine held when its rollout began (the optimizer step
of the last weight sync), and each token with the version a rollout server says sampled it (with
--partial_rollouts a row paused by a sync continues on the new weights: two versions in one trajectory). A sync
that lands while the rollout runs can only make later tokens newer, so a trajectory's oldest token is never older
than the window's tag, and the staleness measured from it is an upper bound.

The producer (one thread, the engine and the reward functions only) keeps up to ``depth`` windows taken and not
yet trained, ``depth = K // steps_per_window`` (the optimizer steps one window trains). With ``wait`` that depth
is the bound: window j starts only once window j - depth is trained, so it is at most depth × steps_per_window
≤ K steps old when its turn comes, and the producer idles meanwhile (counted). With ``drop`` the producer runs
one window further ahead and never waits on versions; a window found more than K steps old when its turn comes
is dropped, its prompts handed back to the stream and counted; it is rolled out again before any new window, and
the windows drawn after it wait for it (and may be dropped in turn): windows train in the order they were drawn,
so a run of N windows trains the stream's first N, whatever was dropped.

Every window taken and not trained is ``pending``: a checkpoint stores their start positions and a resume draws
them again before new ones (trainers/prompts.py), so each prompt is trained exactly once across restarts.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: the producer is handed in
    from grpokit.trainers.window import WindowRollout
    from grpokit.trainers.window_producer import WindowProducer


@dataclass(eq=False)  # taken out of the queue by identity
class _Ready:
    start: int  # the window's stream position
    prompts: list[dict]
    rollout: WindowRollout
    version: int  # the weight version its rollout began with


class RolloutBuffer:
    """A bounded buffer of rolled-out windows. ``next(step)`` returns the oldest window fresh enough for ``step``
    (waiting for one if none is ready); ``pending()`` the windows taken and not trained; ``drain()`` stops the
    producer after the rollout it is running."""

    @classmethod
    def for_run(cls, producer: WindowProducer, r, plan) -> RolloutBuffer | None:
        """--max_staleness K > 0 (or --async_generate true: one window ahead) as the run's options ask, or None."""
        steps = plan.optimizer_steps_per_window
        k = r.max_staleness if r.max_staleness is not None else (steps if r.async_generate else 0)
        if not k:
            return None
        return cls(producer, max_staleness=k, steps_per_window=steps, policy=r.staleness_policy)

    def __init__(self, producer: WindowProducer, *, max_staleness: int, steps_per_window: int, policy: str) -> None:
        if max_staleness < steps_per_window:
            raise ValueError(f"max_staleness {max_staleness} is less than one window ({steps_per_window} steps)")
        self._producer = producer
        self.max_staleness, self.policy = max_staleness, policy
        self.depth = max_staleness // steps_per_window
        self._capacity = self.depth + (policy == "drop")  # windows taken and not trained, at most
        self._ready: deque[_Ready] = deque()
        self._running: int | None = None  # the start of the window being rolled out
        self._error: BaseException | None = None
        self._stopping = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._counts = {"producer_idle_s": 0.0, "producer_waits": 0.0, "dropped": 0.0}

    # -- the loop's side ---------------------------------------------------------------------------------------
    def next(self, step: int) -> tuple[list[dict], WindowRollout, dict[str, float]]:
        """The prompts and rollout of the next window to train at optimizer step ``step``, and its async metrics."""
        self._start()
        t0 = time.perf_counter()
        dropped = 0
        with self._cond:
            fill = len(self._ready)
            while True:
                while (item := self._first_drawn()) is None and self._error is None:
                    self._cond.wait()
                if self._error is not None:
                    raise self._error
                self._ready.remove(item)
                if step - item.version <= self.max_staleness:
                    break
                dropped += len(item.rollout.outputs)  # too old: drawn again, and trained before any later window
                self._producer.prompts.requeue([item.start])
                self._cond.notify_all()  # the producer rolls it out again first, even with the buffer full
            self._cond.notify_all()  # room for the producer
            counts, self._counts = self._counts, {k: 0.0 for k in self._counts}
        wait = time.perf_counter() - t0
        counts["dropped"] += dropped
        metrics = {
            **age_metrics(step, item.rollout.outputs, [item.version] * len(item.rollout.outputs)),
            "async/buffer_fill": float(fill),
            "async/wait_s": wait,
            "async/time_saved_s": max(0.0, item.rollout.timing["rollout"] - wait),
            **{f"async/{k}": v for k, v in counts.items()},
        }
        return item.prompts, item.rollout, metrics

    def _first_drawn(self) -> _Ready | None:
        """Under the lock: the ready window drawn first of all those not trained, or None while that one is still
        to be rolled out (again). Windows train in draw order, whatever was dropped."""
        first = self._producer.prompts.first_drawn(r.start for r in self._ready)
        if self._running is not None and first is not None:
            first = min(first, self._running)
        return next((r for r in self._ready if r.start == first), None)

    def _behind_a_replay(self) -> bool:
        """Under the lock: a dropped window waits to be rolled out again and every ready one was drawn after it
        (the loop waits for it: the producer takes it whatever the buffer holds)."""
        replay = self._producer.prompts.replay
        return bool(replay) and all(r.start > min(replay) for r in self._ready)

    def pending(self) -> list[int]:
        """Start positions of the windows taken from the stream and not trained (ready or being rolled out)."""
        with self._cond:
            return sorted([r.start for r in self._ready] + ([] if self._running is None else [self._running]))

    def loop_position(self) -> tuple[int, list[int]]:
        """The stream's frontier and every window drawn and not trained (``pending()`` and the stream's ``replay``),
        read at one instant. The producer draws only under this lock: a window drawn between two separate reads
        would lie behind the frontier and in no pending list, and a resume would skip it."""
        stream = self._producer.prompts
        with self._cond:  # an RLock: pending() takes it again
            return stream.position, sorted(set(self.pending()) | set(stream.replay))

    def drain(self) -> None:
        """Stop the producer (after the rollout it is running; its windows stay pending, never trained)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- the producer's side ------------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None and not self._stopping:
            self._thread = threading.Thread(target=self._produce, name="grpokit-rollout", daemon=True)
            self._thread.start()

    def _produce(self) -> None:
        try:
            while True:
                with self._cond:
                    t0, waited = time.perf_counter(), False
                    while (
                        len(self._ready) + (self._running is not None) >= self._capacity
                        and not self._behind_a_replay()
                        and not self._stopping
                    ):
                        waited = True
                        self._cond.wait()
                    if self._stopping:
                        return
                    self._counts["producer_idle_s"] += time.perf_counter() - t0
                    self._counts["producer_waits"] += waited
                    # taken and marked under one lock: a checkpoint never misses a window in between
                    start, prompts = self._producer.prompts.take()
                    self._running = start
                version = self._producer.weights_at
                rollout = self._producer.rollout(prompts, version=version)
                with self._cond:
                    self._ready.append(_Ready(start, prompts, rollout, version))
                    self._running = None
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - raised on the loop's thread at its next window
            with self._cond:
                self._error = e
                self._cond.notify_all()


def age_metrics(step: int, outputs: list, versions: list[int]) -> dict[str, float]:
    """Staleness at optimizer step ``step``: each trajectory's age from its oldest token (``versions``: the
    version its rollout began with, where the tokens carry none), and how many span two versions or more."""
    oldest = [o.oldest_weight_version() for o in outputs]
    ages = [step - (start if v is None else v) for v, start in zip(oldest, versions, strict=True)]
    partial = sum(len({v for seg in o.weight_versions for v in seg}) > 1 for o in outputs)
    return {
        "async/staleness": max(ages),
        "async/staleness_max": max(ages),
        "async/staleness_mean": sum(ages) / len(ages),
        "async/partial_trajectories": float(partial),
    }
