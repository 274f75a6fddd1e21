"""Run a batch of completions through every reward function and collect an [N, F] score matrix.

Sync rewards run in order on the caller's thread. All async rewards of a batch are awaited together with
``asyncio.gather`` on one long-lived ``grpokit.aio.LoopThread`` (started once, on first need), and they run
while the sync rewards do, so an I/O-bound judge overlaps with rule-based checks. A reward that breaks the
contract stops training with a one-line ``RewardError``. To name the first bad sample of a reward that raised,
the runner bisects the batch: at most ⌈log2 N⌉ + 1 more calls, on halves, never one call per sample.

Slow and runaway rewards (``--reward_timeout``, ``heartbeat_s``): with a timeout, each sync reward runs in a
process of its own (``worker.RewardWorker``), killed with its process group at the deadline, so a reward stuck in
C code that holds the GIL is cut off too; each async reward runs under ``asyncio.wait_for``, and one that blocks
the event loop (``time.sleep`` in an ``async def``) is caught by the caller's own deadline on the whole batch. A
reward past its deadline is a ``RewardError`` that names it and the limit. Without a timeout sync rewards run on
the caller's thread (math-verify's own signal-based limit needs the main thread). Either way, a line "reward X
still running after N s" is logged every ``heartbeat_s`` while a reward is slow. Anything a reward raises,
``BaseException`` included (``sys.exit(0)``, ``SystemExit``, ``GeneratorExit``, a stray ``CancelledError``), is a
reward error naming it; only ``KeyboardInterrupt`` (the user's Ctrl-C) goes through as it is. A return value must
be a list, tuple, 1-D array or 1-D tensor of exactly N numbers or None; any other shape is refused.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from grpokit.aio import LoopThread
from grpokit.errors import ConfigError, GrpokitError, RewardError
from grpokit.rewards.base import AsyncORM, accepted_kwargs
from grpokit.rewards.calling import (
    RewardLog,
    as_trainer_state,
    check_scores,
    convention,
    is_conversational,
    preview,
    swift_kwargs,
    trl_kwargs,
)
from grpokit.rewards.deadline import HEARTBEAT_S, DeadlinePassed, Raised, call_in_worker, watch
from grpokit.rewards.worker import RemoteRaised, RewardWorker

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
_BLOCKED_GRACE_S = 2.0  # past --reward_timeout, how long the caller waits for an async reward blocking the loop


def is_async_reward(func: Any) -> bool:
    """True for AsyncORM instances, ``async def`` functions and objects whose ``__call__`` is ``async def``."""
    if isinstance(func, AsyncORM) or inspect.iscoroutinefunction(func):
        return True
    call = getattr(type(func), "__call__", None)
    return not inspect.isfunction(func) and inspect.iscoroutinefunction(call)


class RewardRunner:
    """Calls reward functions on a batch and returns scores as a float32 tensor [N, F] (NaN = not scored)."""

    def __init__(
        self, funcs: list[Any], names: list[str], timeout: float | None = None, heartbeat_s: float = HEARTBEAT_S
    ) -> None:
        if len(funcs) != len(names):
            raise ConfigError(f"RewardRunner: {len(funcs)} reward functions but {len(names)} names")
        self.funcs = list(funcs)
        self.names = list(names)
        self.timeout: float | None = None
        self.heartbeat_s = HEARTBEAT_S
        self._heartbeat = Heartbeat(HEARTBEAT_S)
        self.set_limits(timeout, heartbeat_s)
        self._is_async = [is_async_reward(f) for f in self.funcs]
        self._accepts = [accepted_kwargs(f) for f in self.funcs]
        self._trl = [convention(f) == "trl" for f in self.funcs]
        self._loop: LoopThread | None = LoopThread("grpokit-reward-loop") if any(self._is_async) else None
        self._workers: dict[int, RewardWorker] = {}  # sync rewards under --reward_timeout, by index
        if self.timeout is not None:
            self._start_workers()

    # -- public ------------------------------------------------------------------------------------------------

    def set_limits(self, timeout: float | None, heartbeat_s: float = HEARTBEAT_S) -> None:
        """``timeout``: seconds one reward call may take (None: no limit, --reward_timeout); ``heartbeat_s``:
        how often a slow reward is reported."""
        for flag, value, allow_none in (("--reward_timeout", timeout, True), ("heartbeat_s", heartbeat_s, False)):
            if value is None and allow_none:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
                raise ConfigError(
                    f"{flag} {value!r}: must be a positive number of seconds"
                    + (" (or unset for no limit)" if allow_none else "")
                )
        self.timeout = None if timeout is None else float(timeout)
        self.heartbeat_s = self._heartbeat.every = float(heartbeat_s)

    def compute(self, completions: list[str], kwargs: dict[str, Any], log: RewardLog | None = None) -> torch.Tensor:
        """Score ``completions`` with every function; ``kwargs`` holds columns (lists of length N) and extras.
        What the functions record with ``log_extra``/``log_metric`` goes into ``log`` (dropped when None)."""
        import torch

        n = len(completions)
        if "trainer_state" in kwargs:
            kwargs = {**kwargs, "trainer_state": as_trainer_state(kwargs["trainer_state"])}
        log = log if log is not None else RewardLog(n)
        scores = torch.full((n, len(self.funcs)), float("nan"), dtype=torch.float32)  # [N, F]
        async_idx = [i for i, a in enumerate(self._is_async) if a]
        started = time.monotonic()
        pending = self._start_async(async_idx, completions, kwargs, log) if async_idx else None
        try:
            for i, func in enumerate(self.funcs):
                if self._is_async[i]:
                    continue
                try:
                    out = self._call_sync(i, completions, kwargs, log)
                except (GrpokitError, KeyboardInterrupt):
                    raise
                except BaseException as exc:  # noqa: BLE001 - sys.exit(0) in a reward must not end the run quietly
                    raise self._raised_error(i, exc, completions, kwargs) from exc
                scores[:, i] = check_scores(self.names[i], out, completions)
            results = self._wait_async(pending, started) if pending is not None else []
        except BaseException:
            if pending is not None:
                pending[0].cancel()  # Ctrl-C or an error elsewhere: do not wait for the async rewards
            raise
        for i, out in zip(async_idx, results):
            if isinstance(out, GrpokitError):
                raise out
            if isinstance(out, KeyboardInterrupt):
                raise out
            if isinstance(out, BaseException):
                raise self._raised_error(i, out, completions, kwargs) from out
            scores[:, i] = check_scores(self.names[i], out, completions)
        self._warn_unscored(scores)
        return scores

    def close(self) -> None:
        """Stop the event loop thread (if one was started), the heartbeat's and the reward worker processes."""
        self._heartbeat.close()
        for worker in self._workers.values():
            worker.close()
        self._workers.clear()
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- calling -------------------------------------------------------------------------------------------------

    def _kwargs_for(self, i: int, kwargs: dict[str, Any]) -> dict[str, Any]:
        accepts = self._accepts[i]
        if accepts is None:
            return kwargs
        return {k: v for k, v in kwargs.items() if k in accepts}

    def _arguments(self, i: int, completions: list[str], kwargs: dict[str, Any], log: RewardLog) -> tuple:
        """Function i's arguments in its convention: completions positionally (ms-swift), or all by keyword (TRL)."""
        kwargs = {**kwargs, **log.hooks(self.names[i])}
        if self._trl[i]:
            return (), self._kwargs_for(i, trl_kwargs(completions, kwargs, is_conversational(self.funcs[i])))
        return (completions,), self._kwargs_for(i, swift_kwargs(kwargs))

    def _invoke(self, i: int, completions: list[str], kwargs: dict[str, Any], log: RewardLog) -> Any:
        args, kw = self._arguments(i, completions, kwargs, log)
        return self.funcs[i](*args, **kw)

    def _ensure_loop(self) -> LoopThread:
        if self._loop is None:
            self._loop = LoopThread("grpokit-reward-loop")
        return self._loop

    def _await(self, i: int, awaitable: Awaitable[Any]) -> Any:
        """Await on the loop thread, under the timeout (a plain def that returned a coroutine)."""
        timeout = self.timeout

        async def wrap() -> Any:
            try:
                return await (asyncio.wait_for(awaitable, timeout) if timeout is not None else awaitable)
            except BaseException as exc:  # noqa: BLE001 - SystemExit would stop the loop thread itself
                return Raised(exc)

        future = self._ensure_loop().submit(wrap())
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout + _BLOCKED_GRACE_S
        try:
            watch(future.done, lambda: [self.names[i]], started, self.heartbeat_s, deadline, future.result)
        except DeadlinePassed:
            future.cancel()
            self._abandon_loop()
            raise self._timeout_error(i) from None
        out = future.result()
        if isinstance(out, Raised):
            if isinstance(out.error, asyncio.TimeoutError):
                raise self._timeout_error(i) from None
            raise out.error
        return out

    def _call_sync(self, i: int, completions: list[str], kwargs: dict[str, Any], log: RewardLog) -> Any:
        """Reward i (sync) on this thread, or with --reward_timeout in its worker process, killed at the deadline;
        "still running" lines while it is slow. A coroutine it returns is awaited."""
        if self.timeout is None or _in_process(self.funcs[i]):
            call = lambda: self._invoke(i, completions, kwargs, log)  # noqa: E731
            try:
                out = (
                    self._heartbeat.call(call, self.names[i])
                    if self.timeout is None
                    else call_in_worker(call, self.names[i], self.timeout, self.heartbeat_s)
                )
            except DeadlinePassed:
                raise self._timeout_error(i) from None
            return self._await(i, out) if inspect.isawaitable(out) else out
        worker = self._start_workers()[i]
        args, kw = self._arguments(i, completions, kwargs, log)
        try:
            return worker.call(args, kw, log, self.timeout, self.heartbeat_s)
        except DeadlinePassed:
            raise self._timeout_error(i) from None

    def _start_workers(self) -> dict[int, RewardWorker]:
        """A worker process per sync reward, started and loaded (before any call's deadline starts)."""
        for i, func in enumerate(self.funcs):
            if not self._is_async[i] and not _in_process(func):
                self._workers.setdefault(i, RewardWorker(func, self.names[i])).start()
        return self._workers

    def _start_async(
        self, idx: list[int], completions: list[str], kwargs: dict[str, Any], log: RewardLog
    ) -> tuple[Future, dict[int, bool]]:
        timeout, done = self.timeout, {i: False for i in idx}

        async def call(i: int) -> Any:
            try:
                coro = self._invoke(i, completions, kwargs, log)
                return await (asyncio.wait_for(coro, timeout) if timeout is not None else coro)
            except asyncio.TimeoutError:
                return self._timeout_error(i)
            except KeyboardInterrupt:
                return KeyboardInterrupt()
            except BaseException as exc:  # noqa: BLE001 - SystemExit would stop the loop thread itself
                return exc
            finally:
                done[i] = True

        async def run_all() -> list[Any]:
            return await asyncio.gather(*(call(i) for i in idx))

        return self._ensure_loop().submit(run_all()), done

    def _wait_async(self, pending: tuple[Future, dict[int, bool]], started: float) -> list[Any]:
        """The async rewards' results; a RewardError for any still running past --reward_timeout (one that
        blocks the loop thread, so that asyncio's own timeout cannot fire)."""
        future, done = pending
        deadline = None if self.timeout is None else started + self.timeout + _BLOCKED_GRACE_S
        try:
            watch(
                future.done,
                lambda: [self.names[i] for i, d in done.items() if not d],
                started,
                self.heartbeat_s,
                deadline,
                future.result,
            )
        except DeadlinePassed:
            future.cancel()
            self._abandon_loop()
            late = [i for i, d in done.items() if not d]
            raise self._timeout_error(late[0], blocking=True) from None
        return future.result()

    def _abandon_loop(self) -> None:
        """A reward blocks the loop thread: leave it (a daemon) and start a fresh loop when one is needed."""
        self._loop = None

    def _timeout_error(self, i: int, blocking: bool = False) -> RewardError:
        why = " (it blocks the event loop: an async reward must await, not sleep or compute)" if blocking else ""
        return RewardError(
            f"reward {self.names[i]!r} timed out after {self.timeout:g} s (--reward_timeout "
            f"{self.timeout:g}){why}; make it faster or raise --reward_timeout"
        )

    def _call_one(self, i: int, completions: list[str], kwargs: dict[str, Any]) -> Any:
        if self._is_async[i]:
            return self._await(i, self._invoke(i, completions, kwargs, RewardLog(len(completions))))
        return self._call_sync(i, completions, kwargs, RewardLog(len(completions)))

    # -- checking ------------------------------------------------------------------------------------------------

    def _raised_error(self, i: int, exc: BaseException, completions: list[str], kwargs: dict[str, Any]) -> RewardError:
        name = self.names[i]
        where = self._first_failing_sample(i, completions, kwargs)
        sample = (
            f"first failing sample {where} {preview(completions[where])}"
            if where is not None
            else "no single sample fails alone"
        )
        kind = exc.type_name if isinstance(exc, RemoteRaised) else type(exc).__name__
        msg = str(exc).splitlines()[0] if str(exc) else ""
        code = exc.exit_code if isinstance(exc, RemoteRaised) else getattr(exc, "code", None)
        if kind == "SystemExit":
            msg = f"exit status {code!r}; a reward must return scores, not end the process"
        return RewardError(f"reward {name!r} raised {kind}: {msg} ({sample})")

    def _first_failing_sample(self, i: int, completions: list[str], kwargs: dict[str, Any]) -> int | None:
        """The first sample that fails alone, found by halving the failing range: at most ⌈log2 N⌉ + 1 calls
        (the left half is tried; it fails, or the right half is where the failure is); None when that sample
        passes alone (the failure needs several samples together)."""
        lo, hi, seen = 0, len(completions), True  # [lo, hi) fails: seen failing, or inferred from its sibling
        while hi - lo > 1:
            mid = (lo + hi) // 2
            seen = self._fails(i, completions, kwargs, lo, mid)
            lo, hi = (lo, mid) if seen else (mid, hi)
        return lo if hi > lo and (seen or self._fails(i, completions, kwargs, lo, hi)) else None

    def _fails(self, i: int, completions: list[str], kwargs: dict[str, Any], lo: int, hi: int) -> bool:
        n = len(completions)
        part = {k: v[lo:hi] if isinstance(v, (list, tuple)) and len(v) == n else v for k, v in kwargs.items()}
        try:
            self._call_one(i, completions[lo:hi], part)
        except KeyboardInterrupt:
            raise
        except BaseException:  # noqa: BLE001 - a timeout (RewardError) or what the full call raised
            return True
        return False

    def _warn_unscored(self, scores: torch.Tensor) -> None:
        if scores.numel() == 0:
            return
        unscored = scores.isnan().all(dim=1)  # [N]
        count = int(unscored.sum())
        if count:
            first = int(unscored.nonzero()[0, 0])
            logger.warning(
                "%d of %d samples got no score from any reward function (first: sample %d); they count as reward 0",
                count,
                scores.shape[0],
                first,
            )


def _in_process(func: Any) -> bool:
    """A reward whose state lives in the trainer (a reward model's weights, ``in_process = True``): under
    --reward_timeout it runs in a daemon thread with the deadline, not in a worker process."""
    return getattr(func, "in_process", False) is True


class Heartbeat:
    """One daemon thread (started on first use) that logs the heartbeat of the reward call in progress on the
    caller's thread. It polls ten times per ``every`` instead of being woken for each call: a thread started or
    notified per call costs the caller a GIL hand-over (up to the 5 ms switch interval) on every call."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._current: list | None = None  # [name, started, beats logged]; swapped whole, read by the thread
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def call(self, call: Callable[[], Any], name: str) -> Any:
        """``call()`` on this thread, with "still running" lines while it runs."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="grpokit-reward-heartbeat", daemon=True)
            self._thread.start()
        self._current = [name, time.monotonic(), 0]
        try:
            return call()
        finally:
            self._current = None

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(self.every / 10):
            current = self._current
            if current is None:
                continue
            name, started, beats = current
            elapsed = time.monotonic() - started
            if elapsed >= (beats + 1) * self.every:
                logger.warning("reward %r still running after %.1f s", name, elapsed)
                current[2] = int(elapsed // self.every)
