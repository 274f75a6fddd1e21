"""Every HTTP surface grpokit serves, hardened alike by construction: the rollout server (``grpokit rollout``), the
trainer's OpenAI endpoint for ``--agent`` (``LocalEndpoint``) and the viewer's ``grpokit view --serve``.

A surface is an ASGI application handed to ``hardened``, which puts the guard (server/guard.py: Host and cross-site
checks, API key, body and parsed-size budgets) and the error net (server/errors.py: one JSON error shape, never a
connection dropped by an exception) around it, and served by ``serve`` (in the foreground: a command's whole
process) or ``BackgroundServer`` (a thread of a process that does other work, such as the trainer's), both on the
guarded transport (server/transport.py: phase deadlines answered with 408, a connection cap below the descriptor limit,
throttled accept errors). A surface of a process with files of its own to write (the trainer's checkpoints and
logs) gets at most half of the descriptors left (``shared_limits``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from collections.abc import Callable

from grpokit.errors import ConfigError, RolloutError
from grpokit.server.errors import ErrorMiddleware
from grpokit.server.guard import GuardMiddleware, GuardPolicy
from grpokit.server.options import TransportLimits
from grpokit.server.transport import GuardedServer, connection_cap, serve, server_config

__all__ = ["BackgroundServer", "hardened", "serve", "shared_limits"]

START_LIMIT_S = 20.0


def hardened(app, policy: GuardPolicy, shape: Callable | None = None) -> ErrorMiddleware:
    """``app`` behind the guard and the error net; ``shape`` (e.g. the OpenAI error shape) wraps the guard."""
    inner = GuardMiddleware(app, policy)
    return ErrorMiddleware(shape(inner) if shape is not None else inner)


def shared_limits(limits: TransportLimits | None = None) -> TransportLimits:
    """``limits`` (defaults: the rollout server's) with a connection cap of half what the descriptor limit leaves,
    so that connections never take the descriptors the process's own files need."""
    limits = limits or TransportLimits()
    cap = max(16, connection_cap(0) // 2)
    return dataclasses.replace(limits, max_connections=min(limits.max_connections, cap))


class BackgroundServer:
    """``app`` served on the guarded transport from a daemon thread, on ``host`` and ``port`` (0: a free one, the
    bound one is ``port``); ``url`` is its base; ``close()`` stops it. The process's signals stay its own."""

    def __init__(self, app, limits: TransportLimits, *, host: str = "127.0.0.1", port: int = 0, name: str) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise ConfigError(
                f"{name}: cannot listen on {host}:{port}: {e.strerror or e}; choose another port (0 picks a free one)"
            ) from e
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = server_config(
            app, host, self.port, limits, log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=5,
        )  # fmt: skip
        self._server = GuardedServer(config)
        self._server.install_signal_handlers = lambda: None  # the process owns its signals
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        waited = threading.Event()
        for _ in range(int(START_LIMIT_S / 0.01)):
            if self._server.started or not self._thread.is_alive():
                break
            waited.wait(0.01)
        if not self._server.started:
            self._sock.close()
            raise RolloutError(f"{name}: the HTTP server did not start (see the log above)")

    def _serve(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
