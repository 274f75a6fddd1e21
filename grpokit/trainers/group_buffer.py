"""--stream_groups true: the buffer of --max_staleness holds groups, not windows. GRPO's advantages need a whole
group and nothing more, so a group is taken to train as soon as its ``num_generations`` completions are scored,
and a window is the first ``groups per window`` groups ready (oldest weights first); a long trajectory delays only
its own group.

Producers: one per rollout server in server mode (each sends its groups to its own server), else one. A producer
keeps its groups in flight as separate calls (tasks on an event loop of its own thread) and scores each as soon
as its call returns. So a trajectory waiting on a slow tool or environment, or a slow server, holds back only its
own groups; an engine that batches requests arriving together answers them together (its batch is the grain).

The prompt stream draws one prompt (one group) at a time, so a group is named by its stream position, the
prompt's ordinal. Every group drawn and not yet taken to train is ``outstanding`` (in flight or ready): a
checkpoint stores their ordinals and a resume draws them again first, so each prompt is trained exactly once.

Staleness (a group's version is the engine's weight version when its call began; the oldest any token can be):
- ``wait``: at most ``depth × groups per window`` groups are outstanding (depth = K // steps per window). Groups
  finish out of order, so the loop takes, earliest deadline first, as many of the oldest outstanding groups as
  the later windows could not fit before their deadlines (waiting for those still in flight), then fills the
  window with ready ones. With that cap every group trains within K steps (by the earliest-deadline argument:
  every deadline bucket holds no more groups than the windows before it can train).
- ``drop``: one window's groups more may be outstanding, nothing is waited for; a ready group more than K steps
  old is dropped and its prompt drawn again before any new one.
Under either policy groups overtake each other only within an epoch: no group of epoch e + 1 trains while one of
epoch e (a dropped one drawn again included) is untrained, so an epoch's steps train its prompts, each once.
Dynamic sampling refills from the stream: a ready group without signal is skipped (its prompt consumed, as the
windowed DAPO loop consumes a resampled window's), at most ``max_resample_times`` windows' worth per window; after
that, signal-free groups fill the window.
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
from grpokit.trainers.rollout_buffer import RolloutBuffer, age_metrics
from grpokit.trainers.window import WindowRollout

POLL_S = 0.02  # how often an idle producer looks for room, and a busy one for its stop


@dataclass
class _Group:
    position: int  # the prompt's stream position: its ordinal
    prompt: dict
    requests: list
    outputs: list
    rewards: torch.Tensor  # [G, F]
    version: int  # the engine's weight version when its call began
    producer: int
    seconds: float  # its call, from sending to the answer
    reward_s: float


def buffer_for_run(producer, r, plan) -> RolloutBuffer | GroupBuffer | None:
    """The run's buffer of asynchronous training: of groups with --stream_groups, of windows otherwise, or None."""
    if not r.stream_groups:
        return RolloutBuffer.for_run(producer, r, plan)
    k = r.max_staleness if r.max_staleness is not None else plan.optimizer_steps_per_window
    a = producer.algorithm
    return GroupBuffer(
        producer,
        producer_calls(producer),
        max_staleness=k,
        steps_per_window=plan.optimizer_steps_per_window,
        groups_per_window=plan.prompts_per_rollout,
        policy=r.staleness_policy,
        dynamic_sample=a.dynamic_sample,
        max_resample_times=a.max_resample_times,
    )


def loop_position(buffer, stream) -> tuple[int, list[int]]:
    """What a checkpoint stores of the stream: its frontier and the start positions of every draw (a window; a
    group with --stream_groups) taken and not trained (rolled out ahead, or handed back to ``stream``)."""
    return buffer.loop_position() if buffer is not None else (stream.position, sorted(stream.replay))


def producer_calls(producer) -> list[Callable[[list], Awaitable[list]]]:
    """One async call per producer: requests -> trajectories. One per rollout server where the scheduler has
    several; a ``_generate_completions`` override is one producer, its calls taking turns."""
    scheduler, config = producer.scheduler, producer.request_config
    if producer.hooks.generate is not None:
        hook, lock = producer.hooks.generate, threading.Lock()

        def locked(requests):
            with lock:
                return hook(requests)

        return [lambda requests: asyncio.to_thread(locked, requests)]
    servers = getattr(scheduler, "num_servers", 1)
    if servers > 1:
        return [_on_server(scheduler, config, i) for i in range(servers)]
    return [lambda requests: scheduler.async_infer(requests, config)]


def _on_server(scheduler, config, server: int):
    return lambda requests: scheduler.async_infer(requests, config, server=server)


class GroupBuffer:
    """A bounded buffer of scored groups fed by one thread per producer. ``next(step)`` returns the next window's
    prompts, rollout and async metrics; ``pending()`` the ordinals drawn and not taken; ``drain()`` stops the
    producers (their calls in flight are cancelled; those prompts stay pending)."""

    def __init__(
        self,
        producer,
        calls: list[Callable[[list], Awaitable[list]]],
        *,
        max_staleness: int,
        steps_per_window: int,
        groups_per_window: int,
        policy: str,
        dynamic_sample: bool = False,
        max_resample_times: int = 0,
    ) -> None:
        if max_staleness < steps_per_window:
            raise ValueError(f"max_staleness {max_staleness} is less than one window ({steps_per_window} steps)")
        self._producer, self._calls = producer, calls
        self.max_staleness, self.policy = max_staleness, policy
        self.steps_per_window, self.groups_per_window = steps_per_window, groups_per_window
        self.depth = max_staleness // steps_per_window
        self._capacity = (self.depth + (policy == "drop")) * groups_per_window  # outstanding groups, at most
        self._per_producer = math.ceil(self._capacity / len(calls))  # in flight on one producer, at most
        self._skip_limit = max_resample_times * groups_per_window if dynamic_sample else 0
        self._weights = producer.rewards.weights
        self._outstanding: dict[int, int] = {}  # ordinal -> version, of every group drawn and not taken
        self._ready: list[_Group] = []
        self._error: BaseException | None = None
        self._stopping = False
        self._cond = threading.Condition(threading.RLock())
        self._score_lock = threading.Lock()  # the reward functions see one group at a time
        self._threads: list[threading.Thread] = []
        self._counts = {"producer_idle_s": 0.0, "producer_waits": 0.0, "dropped": 0.0}

    # -- the loop's side ---------------------------------------------------------------------------------------
    def next(self, step: int) -> tuple[list[dict], WindowRollout, dict[str, float]]:
        """The prompts and rollout of the next window to train at optimizer step ``step``, and its metrics."""
        self._start()
        t0 = time.perf_counter()
        chosen: list[_Group] = []
        skipped = filler = 0  # dynamic sampling: groups without signal skipped, and taken once it ran out
        with self._cond:
            fill = len(self._ready)
            while len(chosen) < self.groups_per_window:
                group = self._pick(step)
                if group is None:
                    self._cond.wait(timeout=1.0)
                    continue
                if self._skip_limit and not self._has_signal(group):
                    if skipped < self._skip_limit:
                        skipped += 1  # the next group from the stream instead
                        continue
                    filler += 1
                chosen.append(group)
            overtaken = sum(g.position > min(self._outstanding, default=g.position) for g in chosen)
            self._cond.notify_all()  # room for the producers
            counts, self._counts = self._counts, {k: 0.0 for k in self._counts}
        wait = time.perf_counter() - t0
        rollout = WindowRollout(
            [r for g in chosen for r in g.requests],
            [o for g in chosen for o in g.outputs],
            torch.cat([g.rewards for g in chosen]),
            {"rollout": max(g.seconds for g in chosen), "reward": sum(g.reward_s for g in chosen)},
            sampled=self._sampled(skipped, filler),
        )
        versions = [g.version for g in chosen for _ in g.outputs]
        metrics = {
            **age_metrics(step, rollout.outputs, versions),
            "async/buffer_fill": float(fill),
            "async/wait_s": wait,
            "async/time_saved_s": max(0.0, rollout.timing["rollout"] - wait),
            "async/groups_overtaken": float(overtaken),
            **{f"async/{k}": v for k, v in counts.items()},
        }
        for i in range(len(self._calls)):
            metrics[f"async/producer{i}_groups"] = float(sum(g.producer == i for g in chosen))
        return [g.prompt for g in chosen], rollout, metrics

    def _pick(self, step: int) -> _Group | None:
        """Under the lock: the next group for the window training at ``step``, or None (wait for one)."""
        if self._error is not None:
            raise self._error
        if self.policy == "drop":
            for g in [g for g in self._ready if step - g.version > self.max_staleness]:
                self._ready.remove(g)
                del self._outstanding[g.position]
                self._producer.prompts.requeue([g.position])  # drawn again before any new prompt
                self._counts["dropped"] += len(g.outputs)
        # groups overtake each other within an epoch, never across its end: a group drawn and not trained (a
        # dropped one drawn again included) trains before any group of a later epoch, so each epoch's steps
        # train that epoch's prompts, each once
        stream = self._producer.prompts
        first = stream.first_drawn(self._outstanding)
        epoch = None if first is None else stream.epoch(first)
        ready = [g for g in self._ready if stream.epoch(g.position) == epoch]
        if self.policy == "wait" and self._must_take(step) > 0:  # earliest deadline first: the oldest group
            first = min(self._outstanding, key=lambda pos: (self._outstanding[pos], pos))
            group = next((g for g in ready if g.position == first), None)
        else:
            group = min(ready, key=lambda g: (g.version, g.position), default=None)
        if group is not None:
            self._ready.remove(group)
            del self._outstanding[group.position]
        return group

    def _must_take(self, step: int) -> int:
        """How many outstanding groups this window must still take so that every later window can train the
        groups due by its step: max over j ≥ 1 of (groups due within the first j windows) - (j - 1) windows."""
        must = 0
        for i, version in enumerate(sorted(self._outstanding.values())):
            window = max(1, (version + self.max_staleness - step) // self.steps_per_window + 1)
            must = max(must, i + 1 - (window - 1) * self.groups_per_window)
        return must

    def _has_signal(self, group: _Group) -> bool:
        rewards = torch.nansum(group.rewards * self._weights, dim=1)
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
        """Ordinals of the groups drawn and not taken to train (in flight or ready)."""
        with self._cond:
            return sorted(self._outstanding)

    def loop_position(self) -> tuple[int, list[int]]:
        """The stream's frontier and every prompt drawn and not trained, read at one instant (the producers draw
        under the same lock)."""
        stream = self._producer.prompts
        with self._cond:
            return stream.position, sorted(set(self._outstanding) | set(stream.replay))

    def drain(self) -> None:
        """Stop the producers; their calls in flight are cancelled, those prompts stay pending."""
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
        except BaseException as e:  # noqa: BLE001 - raised on the loop's thread when it next takes a group
            with self._cond:
                self._error = self._error or e
                self._cond.notify_all()

    async def _run(self, index: int) -> None:
        """Keep this producer's share of groups in flight; score each as its call returns."""
        call = self._calls[index]
        flight: dict[asyncio.Future, tuple] = {}
        idle = False  # waiting for room with nothing in flight
        loop = asyncio.get_running_loop()  # rewards are scored beside it, so that the calls in flight go on
        scorer = ThreadPoolExecutor(1, thread_name_prefix=f"{threading.current_thread().name}-rewards")
        try:
            while not self._stopping:
                for position, prompt, version in self._take(len(flight)):
                    requests = self._producer.requests([prompt])
                    flight[asyncio.ensure_future(call(requests))] = (
                        position,
                        prompt,
                        requests,
                        version,
                        time.perf_counter(),
                    )
                if not flight:
                    t0 = time.perf_counter()
                    await asyncio.sleep(POLL_S)
                    with self._cond:
                        self._counts["producer_idle_s"] += time.perf_counter() - t0
                        self._counts["producer_waits"] += not idle
                    idle = True
                    continue
                idle = False
                done, _ = await asyncio.wait(flight, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    position, prompt, requests, version, t0 = flight.pop(task)
                    outputs = self._producer.tag(task.result(), version)
                    seconds, t1 = time.perf_counter() - t0, time.perf_counter()
                    rewards = await loop.run_in_executor(scorer, self._score, requests, outputs)
                    group = _Group(
                        position, prompt, requests, outputs, rewards, version, index, seconds, time.perf_counter() - t1
                    )
                    with self._cond:
                        self._ready.append(group)
                        self._cond.notify_all()
        finally:
            for task in flight:
                task.cancel()
            await asyncio.gather(*flight, return_exceptions=True)
            scorer.shutdown(wait=True)

    def _take(self, in_flight: int) -> list[tuple[int, dict, int]]:
        """New groups for a producer with ``in_flight`` calls running, as far as the bounds allow (drawn and
        marked outstanding under one lock: a checkpoint never misses one in between)."""
        with self._cond:
            room = min(self._capacity - len(self._outstanding), self._per_producer - in_flight)
            if room <= 0 or self._stopping:
                return []
            taken = []
            for _ in range(room):
                position, prompts = self._producer.prompts.take()
                version = self._producer.weights_at
                self._outstanding[position] = version
                taken.append((position, prompts[0], version))
            return taken

    def _score(self, requests: list, outputs: list) -> torch.Tensor:
        with self._score_lock:
            return self._producer.rewards_of(requests, outputs)
