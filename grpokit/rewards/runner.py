"""Run a batch of completions through every reward function and collect an [N, F] score matrix.

Sync rewards run in order on the caller's thread. All async rewards of a batch are awaited together with
``asyncio.gather`` on one long-lived ``grpokit.aio.LoopThread`` (started once, on first need), and they run
while the sync rewards do, so an I/O-bound judge overlaps with rule-based checks. A reward that breaks the
contract stops training with a one-line ``RewardError``; to name the first bad sample of a reward that raised,
the runner calls it again one sample at a time (only on that error path).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import sys
from collections.abc import Awaitable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from grpokit.aio import LoopThread
from grpokit.errors import ConfigError, GrpokitError, RewardError
from grpokit.rewards.base import AsyncORM, accepted_kwargs
from grpokit.rewards.calling import RewardLog, as_trainer_state, convention, is_conversational, swift_kwargs, trl_kwargs

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
_PREVIEW = 60


def is_async_reward(func: Any) -> bool:
    """True for AsyncORM instances, ``async def`` functions and objects whose ``__call__`` is ``async def``."""
    if isinstance(func, AsyncORM) or inspect.iscoroutinefunction(func):
        return True
    call = getattr(type(func), "__call__", None)
    return not inspect.isfunction(func) and inspect.iscoroutinefunction(call)


def _preview(text: Any) -> str:
    s = repr(text)
    return s if len(s) <= _PREVIEW else s[: _PREVIEW - 3] + "..."


class RewardRunner:
    """Calls reward functions on a batch and returns scores as a float32 tensor [N, F] (NaN = not scored)."""

    def __init__(self, funcs: list[Any], names: list[str]) -> None:
        if len(funcs) != len(names):
            raise ConfigError(f"RewardRunner: {len(funcs)} reward functions but {len(names)} names")
        self.funcs = list(funcs)
        self.names = list(names)
        self._is_async = [is_async_reward(f) for f in self.funcs]
        self._accepts = [accepted_kwargs(f) for f in self.funcs]
        self._trl = [convention(f) == "trl" for f in self.funcs]
        self._loop: LoopThread | None = LoopThread("grpokit-reward-loop") if any(self._is_async) else None

    # -- public ------------------------------------------------------------------------------------------------

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
        pending = self._start_async(async_idx, completions, kwargs, log) if async_idx else None
        try:
            for i, func in enumerate(self.funcs):
                if self._is_async[i]:
                    continue
                try:
                    out = self._invoke(i, completions, kwargs, log)
                    if inspect.isawaitable(out):  # a plain def that returned a coroutine
                        out = self._await(out)
                except GrpokitError:
                    raise
                except Exception as exc:
                    raise self._raised_error(i, exc, completions, kwargs) from exc
                scores[:, i] = self._check(i, out, completions)
        finally:
            results = pending.result() if pending is not None else []
        for i, out in zip(async_idx, results):
            if isinstance(out, GrpokitError):
                raise out
            if isinstance(out, BaseException):
                raise self._raised_error(i, out, completions, kwargs) from out
            scores[:, i] = self._check(i, out, completions)
        self._warn_unscored(scores)
        return scores

    def close(self) -> None:
        """Stop the event loop thread (if one was started)."""
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

    def _invoke(self, i: int, completions: list[str], kwargs: dict[str, Any], log: RewardLog) -> Any:
        """Call function i in its convention: completions positionally (ms-swift), or all by keyword (TRL)."""
        kwargs = {**kwargs, **log.hooks(self.names[i])}
        if self._trl[i]:
            return self.funcs[i](**self._kwargs_for(i, trl_kwargs(completions, kwargs,
                                                                  is_conversational(self.funcs[i]))))
        return self.funcs[i](completions, **self._kwargs_for(i, swift_kwargs(kwargs)))

    def _ensure_loop(self) -> LoopThread:
        if self._loop is None:
            self._loop = LoopThread("grpokit-reward-loop")
        return self._loop

    def _await(self, awaitable: Awaitable[Any]) -> Any:
        async def wrap() -> Any:
            return await awaitable

        return self._ensure_loop().submit(wrap()).result()

    def _start_async(self, idx: list[int], completions: list[str], kwargs: dict[str, Any], log: RewardLog) -> Future:
        async def call(i: int) -> Any:
            return await self._invoke(i, completions, kwargs, log)

        async def run_all() -> list[Any]:
            return await asyncio.gather(*(call(i) for i in idx), return_exceptions=True)

        return self._ensure_loop().submit(run_all())

    def _call_one(self, i: int, completions: list[str], kwargs: dict[str, Any]) -> Any:
        out = self._invoke(i, completions, kwargs, RewardLog(len(completions)))
        return self._await(out) if inspect.isawaitable(out) else out

    # -- checking ------------------------------------------------------------------------------------------------

    def _check(self, i: int, out: Any, completions: list[str]) -> torch.Tensor:
        import torch

        name, n = self.names[i], len(completions)
        if isinstance(out, torch.Tensor):
            out = out.detach().float().cpu().reshape(-1).tolist()
        elif hasattr(out, "tolist") and not isinstance(out, (list, tuple)):
            out = out.tolist()  # numpy array
        if not isinstance(out, (list, tuple)):
            raise RewardError(
                f"reward {name!r} returned {type(out).__name__}, not a list of {n} scores (one per completion)"
            )
        if len(out) != n:
            first = min(len(out), n)
            where = f"first sample without a score: {first} {_preview(completions[first])}" if n > first else ""
            raise RewardError(
                f"reward {name!r} returned {len(out)} scores for {n} completions; {where or 'too many scores'}"
            )
        values = []
        for j, v in enumerate(out):
            f = _as_score(v)
            if f is _BAD:
                raise RewardError(
                    f"reward {name!r}: sample {j} got score {_preview(v)} (need a finite number or None); "
                    f"completion {_preview(completions[j])}"
                )
            values.append(f)
        return torch.tensor(values, dtype=torch.float32)

    def _raised_error(self, i: int, exc: BaseException, completions: list[str], kwargs: dict[str, Any]) -> RewardError:
        name = self.names[i]
        where = self._first_failing_sample(i, completions, kwargs)
        sample = (
            f"first failing sample {where} {_preview(completions[where])}"
            if where is not None
            else "no single sample fails alone"
        )
        msg = str(exc).splitlines()[0] if str(exc) else ""
        return RewardError(f"reward {name!r} raised {type(exc).__name__}: {msg} ({sample})")

    def _first_failing_sample(self, i: int, completions: list[str], kwargs: dict[str, Any]) -> int | None:
        n = len(completions)
        for j in range(n):
            row = {k: v[j : j + 1] if isinstance(v, (list, tuple)) and len(v) == n else v for k, v in kwargs.items()}
            try:
                self._call_one(i, completions[j : j + 1], row)
            except Exception:
                return j
        return None

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


_BAD = object()


def _as_score(v: Any) -> Any:
    """float(v), NaN for None/NaN, or _BAD for anything else (strings, inf, containers)."""
    if v is None:
        return math.nan
    torch = sys.modules.get("torch")  # a tensor can only come from an imported torch
    if torch is not None and isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    elif hasattr(v, "item") and getattr(v, "shape", None) == ():
        v = v.item()  # numpy scalar
    if not isinstance(v, numbers.Real):  # bool is an int, so True/False pass as 1.0/0.0
        return _BAD
    f = float(v)
    return _BAD if math.isinf(f) else f
