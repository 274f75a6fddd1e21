"""The buffer of asynchronous training (--max_staleness K, --async_generate): groups rolled out ahead by
background producers while the loop trains, each no more than K optimizer steps older than the weights that train
it. A window is ``groups per window`` groups; the producers draw them from the prompt stream a window at a time
(each draw one rollout call, trained in the order drawn), or with --stream_groups one group at a time (each its
own call, taken to train as soon as its ``num_generations`` completions are scored: a long trajectory delays only
its own group). K = 0 is the same buffer with no room: the loop draws and rolls out each window itself.

Versions: a draw is tagged with the weight version the engine held when its call began (the optimizer step of the
last weight sync), and each token with the version a rollout server says sampled it (with --partial_rollouts a
row paused by a sync continues on the new weights). A sync during the call only makes later tokens newer, so the
staleness measured from a trajectory's oldest token is bounded by its draw's.

Producers: one per rollout server with --stream_groups in server mode (each sends its groups to its own server),
else one. Every producer rolls out through the window producer's one call (rollouts.py's ``rollout_groups``),
sharing the engine with the other calls in flight and taking turns with the loop's own rollouts. A producer keeps
its share of group draws in flight (tasks on an event loop of its own thread) and scores each as its call
returns; a window draw is one call at a time (the engine batches within it).

Every draw not yet taken to train is ``outstanding`` (in flight or ready): a checkpoint stores their stream
positions and a resume draws them again first, so each prompt is trained exactly once.

Staleness (depth = K // steps per window; at most ``depth × groups per window`` groups outstanding):
- ``wait``: the cap is the bound. Window draws train in draw order, so window j is drawn only once window
  j - depth is trained. Groups finish out of order: the loop takes, earliest deadline first, as many of the
  oldest outstanding groups as the later windows could not fit before their deadlines (waiting for those still
  in flight), then fills the window with ready ones; every group then trains within K steps (every deadline
  bucket holds no more groups than the windows before it can train).
- ``drop``: one window's groups more may be outstanding and the producers never wait on versions; a draw more
  than K steps old when its turn comes is dropped and its prompts drawn again before any new one (a window draw
  is waited for: windows train in draw order, so a run of N windows trains the stream's first N).
Groups overtake each other only within an epoch: no group of epoch e + 1 trains while one of epoch e (a dropped
one drawn again included) is untrained, so an epoch's steps train its prompts, each once.
Dynamic sampling with --stream_groups refills from the stream: a ready group without signal is skipped (its prompt
consumed, as the windowed DAPO loop consumes a resampled window's), at most ``max_resample_times`` windows' worth
per window; after that, signal-free groups fill the window.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from grpokit.aio import run_sync
from grpokit.algorithms import groups_with_signal
from grpokit.trainers.staleness import age_metrics, must_take
from grpokit.trainers.window import WindowRollout

POLL_S = 0.02  # how often a busy producer looks for room, and an idle one for its stop
RolloutCall = Callable[..., Awaitable[WindowRollout]]  # (prompts, version, beside=executor) -> the rollout


@dataclass(eq=False)  # taken out of the ready list by identity
class _Draw:
    position: int  # its stream position: the first prompt's ordinal
    prompts: list[dict]
    rollout: WindowRollout
    version: int  # the engine's weight version when its call began
    producer: int


def buffer_for_run(producer, r, plan) -> GroupBuffer:
    """The run's buffer: K = --max_staleness (one window's steps with --async_generate alone), 0 without either."""
    steps = plan.optimizer_steps_per_window
    k = r.max_staleness if r.max_staleness is not None else (steps if r.async_generate else 0)
    stream = bool(r.stream_groups)
    a = producer.algorithm
    return GroupBuffer(
        producer,
        producer.rollout_calls(stream),
        max_staleness=k,
        steps_per_window=steps,
        groups_per_window=plan.prompts_per_rollout,
        groups_per_draw=1 if stream else plan.prompts_per_rollout,
        policy=r.staleness_policy,
        dynamic_sample=stream and a.dynamic_sample,
        max_resample_times=a.max_resample_times,
    )


def loop_position(buffer, stream) -> tuple[int, list[int]]:
    """What a checkpoint stores of the stream: its frontier and the start positions of every draw taken and not
    trained (rolled out ahead, or handed back to ``stream``)."""
    return buffer.loop_position() if buffer is not None else (stream.position, sorted(stream.replay))


class GroupBuffer:
    """A bounded buffer of scored groups fed by one thread per producer. ``next(step)`` returns the next window's
    prompts, rollout (None with K = 0: the loop rolls it out) and async metrics; ``pending()`` the draws taken and
    not trained; ``drain()`` stops the producers (their calls in flight are cancelled; those stay pending)."""

    def __init__(
        self,
        producer,
        calls: list[RolloutCall],
        *,
        max_staleness: int,
        steps_per_window: int,
        groups_per_window: int,
        policy: str,
        groups_per_draw: int = 1,
        dynamic_sample: bool = False,
        max_resample_times: int = 0,
    ) -> None:
        if max_staleness and max_staleness < steps_per_window:
            raise ValueError(f"max_staleness {max_staleness} is less than one window ({steps_per_window} steps)")
        self._producer, self._calls = producer, calls
        self.max_staleness, self.policy = max_staleness, policy
        self.steps_per_window, self.groups_per_window = steps_per_window, groups_per_window
        self._draws_per_window = groups_per_window // groups_per_draw
        self._in_order = self._draws_per_window == 1  # window draws train in the order drawn
        self.depth = max_staleness // steps_per_window
        self._capacity = (self.depth + (policy == "drop")) * self._draws_per_window if self.depth else 0
        self._per_producer = 1 if self._in_order else math.ceil(self._capacity / len(calls))  # in flight
        self._skip_limit = max_resample_times * groups_per_window if dynamic_sample else 0
        self._outstanding: dict[int, int] = {}  # position -> version, of every draw taken and not trained
        self._ready: list[_Draw] = []
        self._error: BaseException | None = None
        self._stopping = False
        self._cond = threading.Condition(threading.RLock())
        self._threads: list[threading.Thread] = []
        self._counts = {"producer_idle_s": 0.0, "producer_waits": 0.0, "dropped": 0.0}

    # -- the loop's side ---------------------------------------------------------------------------------------
    def next(self, step: int) -> tuple[list[dict], WindowRollout | None, dict[str, float]]:
        """The prompts and rollout of the next window to train at optimizer step ``step``, and its metrics."""
        if not self._capacity:  # K = 0: the loop rolls the window out itself, on the weights it just synced
            return self._producer.prompts.next(), None, {}
        self._start()
        t0 = time.perf_counter()
        chosen: list[_Draw] = []
        skipped = filler = 0  # dynamic sampling: groups without signal skipped, and taken once it ran out
        with self._cond:
            fill = len(self._ready)
            while len(chosen) < self._draws_per_window:
                draw = self._pick(step)
                if draw is None:
                    self._cond.wait(timeout=1.0)
                    continue
                if self._skip_limit and not self._has_signal(draw):
                    if skipped < self._skip_limit:
                        skipped += 1  # the next group from the stream instead
                        continue
                    filler += 1
                chosen.append(draw)
            overtaken = sum(d.position > min(self._outstanding, default=d.position) for d in chosen)
            self._cond.notify_all()  # room for the producers
            counts, self._counts = self._counts, {k: 0.0 for k in self._counts}
        wait = time.perf_counter() - t0
        rollout = WindowRollout(
            [r for d in chosen for r in d.rollout.requests],
            [o for d in chosen for o in d.rollout.outputs],
            torch.cat([d.rollout.rewards_per_func for d in chosen]),
            {
                "rollout": max(d.rollout.timing["rollout"] for d in chosen),
                "reward": sum(d.rollout.timing["reward"] for d in chosen),
            },
            sampled=self._sampled(skipped, filler),
        )
        versions = [d.version for d in chosen for _ in d.rollout.outputs]
        metrics = {
            **age_metrics(step, rollout.outputs, versions),
            "async/buffer_fill": float(fill),
            "async/wait_s": wait,
            "async/time_saved_s": max(0.0, rollout.timing["rollout"] - wait),
            **({} if self._in_order else {"async/groups_overtaken": float(overtaken)}),
            **{f"async/{k}": v for k, v in counts.items()},
        }
        for i in range(len(self._calls) if not self._in_order else 0):
            metrics[f"async/producer{i}_groups"] = float(sum(d.producer == i for d in chosen))
        return [p for d in chosen for p in d.prompts], rollout, metrics

    def _pick(self, step: int) -> _Draw | None:
        """Under the lock: the next draw for the window training at ``step``, or None (wait for one)."""
        if self._error is not None:
            raise self._error
        stream = self._producer.prompts
        if self._in_order:  # the draw drawn first of those not trained (a dropped one is waited for)
            first = stream.first_drawn(self._outstanding)
            draw = next((d for d in self._ready if d.position == first), None)
            if draw is not None and self._too_old(draw, step):
                return None
        else:
            if self.policy == "drop":
                for d in [d for d in self._ready if step - d.version > self.max_staleness]:
                    self._too_old(d, step)
            # groups overtake each other within an epoch, never across its end: a group drawn and not trained
            # (a dropped one drawn again included) trains before any group of a later epoch
            first = stream.first_drawn(self._outstanding)
            epoch = None if first is None else stream.epoch(first)
            ready = [d for d in self._ready if stream.epoch(d.position) == epoch]
            if self.policy == "wait" and self._must_take(step) > 0:  # earliest deadline first
                first = min(self._outstanding, key=lambda pos: (self._outstanding[pos], pos))
                draw = next((d for d in ready if d.position == first), None)
            else:
                draw = min(ready, key=lambda d: (d.version, d.position), default=None)
        if draw is not None:
            self._ready.remove(draw)
            del self._outstanding[draw.position]
        return draw

    def _must_take(self, step: int) -> int:
        limits = {"max_staleness": self.max_staleness, "steps_per_window": self.steps_per_window}
        return must_take(self._outstanding.values(), step, per_window=self._draws_per_window, **limits)

    def _too_old(self, draw: _Draw, step: int) -> bool:
        """Under the lock, with ``drop``: a draw more than K steps old is dropped and drawn again first."""
        if self.policy != "drop" or step - draw.version <= self.max_staleness:
            return False
        self._ready.remove(draw)
        del self._outstanding[draw.position]
        self._producer.prompts.requeue([draw.position])  # drawn again before any new prompt
        self._counts["dropped"] += len(draw.rollout.outputs)
        self._cond.notify_all()  # the producer rolls it out again first
        return True

    def _has_signal(self, draw: _Draw) -> bool:
        rewards = torch.nansum(draw.rollout.rewards_per_func * self._producer.rewards.weights, dim=1)
        return bool(groups_with_signal(rewards, torch.zeros(len(rewards), dtype=torch.long)).any())

    def _sampled(self, skipped: int, filler: int) -> dict[str, float] | None:
        """Dynamic sampling's metrics as the windowed loop names them (rounds: windows' worth of groups skipped)."""
        if not self._skip_limit:
            return None
        return {
            "dynamic_sampling/rounds": skipped / self.groups_per_window,
            "dynamic_sampling/groups_without_signal": float(filler),
        }

    def pending(self) -> list[int]:
        """Positions of the draws taken and not trained (in flight or ready)."""
        with self._cond:
            return sorted(self._outstanding)

    def loop_position(self) -> tuple[int, list[int]]:
        """The stream's frontier and every draw taken and not trained (``pending()`` and the stream's ``replay``),
        read at one instant: the producers draw under the same lock (a draw between two separate reads would lie
        behind the frontier and in no pending list, and a resume would skip it)."""
        stream = self._producer.prompts
        with self._cond:
            return stream.position, sorted(set(self._outstanding) | set(stream.replay))

    def drain(self) -> None:
        """Stop the producers; their calls in flight are cancelled, those draws stay pending."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        self._threads = []

    # -- the producers' side ------------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._threads or self._stopping:
            return
        for i in range(len(self._calls)):
            thread = threading.Thread(target=self._produce, args=(i,), name=f"grpokit-rollout-{i}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _produce(self, index: int) -> None:
        try:
            run_sync(self._run(index))
        except BaseException as e:  # noqa: BLE001 - raised on the loop's thread when it next takes a draw
            with self._cond:
                self._error = self._error or e
                self._cond.notify_all()

    async def _run(self, index: int) -> None:
        """Keep this producer's share of draws in flight, each one ``rollout_groups`` call."""
        call = self._calls[index]
        flight: dict[asyncio.Future, tuple[int, list[dict], int]] = {}
        # rewards are scored beside this loop, so that the calls in flight go on
        scorer = ThreadPoolExecutor(1, thread_name_prefix=f"{threading.current_thread().name}-rewards")
        try:
            while not self._stopping:
                for position, prompts, version in self._take(len(flight)):
                    flight[asyncio.ensure_future(call(prompts, version, beside=scorer))] = (position, prompts, version)
                if not flight:
                    self._wait_for_room()
                    continue
                done, _ = await asyncio.wait(flight, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    position, prompts, version = flight.pop(task)
                    with self._cond:
                        self._ready.append(_Draw(position, prompts, task.result(), version, index))
                        self._cond.notify_all()
        finally:
            for task in flight:
                task.cancel()
            await asyncio.gather(*flight, return_exceptions=True)
            scorer.shutdown(wait=True)

    def _wait_for_room(self) -> None:
        """Nothing in flight: wait (counted) until a draw may be taken or the buffer stops."""
        with self._cond:
            t0, waited = time.perf_counter(), False
            while self._room(0) <= 0 and not self._stopping:
                waited = True
                self._cond.wait(timeout=POLL_S)
            self._counts["producer_idle_s"] += time.perf_counter() - t0
            self._counts["producer_waits"] += waited

    def _room(self, in_flight: int) -> int:
        """Under the lock: how many draws a producer with ``in_flight`` calls running may take now. In draw order
        a dropped window drawn again is taken even with the buffer full, when every ready one was drawn after it
        (the loop waits for it)."""
        room = min(self._capacity - len(self._outstanding), self._per_producer - in_flight)
        replay = self._producer.prompts.replay
        if self._in_order and not in_flight and replay and all(d.position > min(replay) for d in self._ready):
            room = max(room, 1)
        return room

    def _take(self, in_flight: int) -> list[tuple[int, list[dict], int]]:
        """New draws for a producer with ``in_flight`` calls running, as far as the bounds allow (drawn and marked
        outstanding under one lock: a checkpoint never misses one in between)."""
        with self._cond:
            if self._stopping:
                return []
            taken = []
            for _ in range(self._room(in_flight)):
                position, prompts = self._producer.prompts.take()
                version = self._producer.weights_at
                self._outstanding[position] = version
                taken.append((position, prompts, version))
            return taken
