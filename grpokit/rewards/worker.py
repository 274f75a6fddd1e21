"""A sync reward under ``--reward_timeout`` runs in a process of its own, which the runner kills at the deadline.

A thread cannot be stopped, and a reward stuck in C code that holds the GIL (a long ``re`` match, big-integer
math, a C library call) would stop the trainer's watcher thread as well. So ``RewardWorker`` keeps one long-lived
process per reward: the function is sent once, by reference (its module and name: a plugin module is imported
again there, its folder being on ``sys.path``), to a fresh interpreter (``processes.start``); a function that
cannot be sent by reference (defined in ``__main__``, a closure, an instance that does not pickle) runs in a
``fork`` of the trainer instead. Each call sends the batch and waits for the answer with the deadline; past it,
the worker's whole process group is killed (the reward's own subprocesses with it) and a fresh worker starts on
the next call.
``log_extra``/``log_metric`` are recorded in the worker and replayed into the caller's log.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
import sys
import time
from typing import Any

from grpokit.errors import ConfigError
from grpokit.rewards import processes
from grpokit.rewards.calling import RewardLog
from grpokit.rewards.deadline import DeadlinePassed, watch

HOOKS = ("log_extra", "log_metric")
_LOAD_S = 30.0  # a "still running" line this often while a worker loads its reward


class RemoteRaised(Exception):
    """What the reward raised in its worker: the type's name and message (the object itself may not pickle)."""

    def __init__(self, type_name: str, message: str, exit_code: Any = None) -> None:
        super().__init__(message)
        self.type_name, self.exit_code = type_name, exit_code


def _by_reference(func: Any) -> bytes | None:
    """``func`` pickled, when the worker can load it by name (not from ``__main__``, not a closure)."""
    target = func if inspect.isfunction(func) or inspect.isclass(func) else type(func)
    if getattr(target, "__module__", "__main__") in ("__main__", "__mp_main__") or "<locals>" in getattr(
        target, "__qualname__", ""
    ):
        return None
    try:
        return pickle.dumps(func)
    except Exception:  # noqa: BLE001 - anything that does not pickle runs in a fork instead
        return None


class RewardWorker:
    """One reward function in a killable process of its own (see the module docstring)."""

    def __init__(self, func: Any, name: str) -> None:
        self.func, self.name = func, name
        self._payload = _by_reference(func)
        self._proc: Any = None
        self._conn: Any = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Start the worker now (a reward that cannot be loaded there fails here), unless it runs already."""
        if self._proc is None or not self._proc.is_alive():
            self._start()

    def _start(self) -> None:
        fork = self._payload is None
        args = (self.func, None) if fork else (self._payload, list(sys.path))
        proc, parent = processes.start(_serve, args, f"grpokit-reward-{self.name}", fork=fork)
        self._proc, self._conn = proc, parent
        try:  # loading the function (its module's imports) is not part of any call's time
            watch(parent.poll, lambda: [self.name], time.monotonic(), _LOAD_S, None, parent.poll)
            kind, *rest = parent.recv()
        except (EOFError, OSError):
            kind, rest = "raised", ["WorkerDied", f"exit code {proc.exitcode}"]
        if kind != "ready":
            self.kill()
            raise ConfigError(
                f"reward {self.name!r}: its worker process for --reward_timeout could not load it "
                f"({rest[0]}: {rest[1]}); the reward must be importable by its module and name"
            )

    def call(self, args: tuple, kwargs: dict, log: RewardLog, timeout: float, heartbeat_s: float) -> Any:
        """``func(*args, **kwargs)`` in the worker within ``timeout`` s (DeadlinePassed after, the worker killed);
        what it raised comes back as ``RemoteRaised`` (``KeyboardInterrupt`` as itself)."""
        hooks = [k for k in HOOKS if k in kwargs]
        sent = {k: v for k, v in kwargs.items() if k not in HOOKS}
        try:
            message = pickle.dumps((args, sent, hooks, log.n, self.name))
        except Exception as exc:  # noqa: BLE001 - a column that does not pickle
            raise ConfigError(
                f"reward {self.name!r}: its inputs cannot be sent to the worker process that --reward_timeout runs it "
                f"in ({type(exc).__name__}: {exc}); unset --reward_timeout or keep the dataset's columns plain data"
            ) from None
        self.start()
        started = time.monotonic()
        try:
            self._conn.send_bytes(message)
            watch(self._conn.poll, lambda: [self.name], started, heartbeat_s, started + timeout, self._conn.poll)
            kind, *rest = self._conn.recv()
        except (DeadlinePassed, KeyboardInterrupt):
            self.kill()
            raise
        except (EOFError, OSError):  # the worker died (os._exit, a signal, the OOM killer)
            proc = self._proc
            self.kill()
            code = proc.exitcode if proc is not None else None
            raise RemoteRaised("WorkerDied", f"its worker process ended (exit code {code})") from None
        if kind == "ok":
            out, extra, metrics = rest
            log.extra.update(extra)
            for key, values in metrics.items():
                log.metrics.setdefault(key, []).extend(values)
            return out
        if kind == "interrupt":
            raise KeyboardInterrupt
        raise RemoteRaised(*rest)

    def kill(self) -> None:
        """Kill the worker, its process group and what it started, and wait for it."""
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        processes.kill(proc, conn)

    close = kill


def _serve(conn: Any, func: Any, path: list[str] | None) -> None:
    """The worker's loop: one batch in, its scores (or what was raised) out."""
    processes.detach()
    if path is not None:
        sys.path[:] = path
        try:
            func = pickle.loads(func)
        except BaseException as exc:  # noqa: BLE001 - reported to the trainer, which names the reward
            conn.send(("raised", type(exc).__name__, str(exc)[:200]))
            return
    conn.send(("ready",))
    while True:
        try:
            args, kwargs, hooks, n, name = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the runner closed its end
            return
        log = RewardLog(n)
        kwargs.update({k: v for k, v in log.hooks(name).items() if k in hooks})
        conn.send(_run(func, args, kwargs, log))


def _run(func: Any, args: tuple, kwargs: dict, log: RewardLog) -> tuple:
    try:
        out = func(*args, **kwargs)
        if inspect.isawaitable(out):  # a plain def that returned a coroutine
            out = asyncio.run(_awaited(out))
        pickle.dumps(out)
        return ("ok", out, log.extra, log.metrics)
    except KeyboardInterrupt:
        return ("interrupt",)
    except BaseException as exc:  # noqa: BLE001 - sys.exit() in a reward is an error to report, not an exit
        code = exc.code if isinstance(exc, SystemExit) else None
        code = code if code is None or isinstance(code, (int, str)) else repr(code)[:80]
        return ("raised", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", code)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
