"""The HTTP/1.1 transport of every grpokit server (server/surface.py: the rollout server, the trainer's --agent
endpoint, ``grpokit view --serve``): uvicorn's h11 protocol with deadlines, a connection cap and quiet logs.

uvicorn arms its keep-alive timer only after a response, so a client that connects and sends nothing, stops inside
its headers, or stops inside a declared body holds its connection (and a file descriptor) for ever. Here every
connection is always under one deadline of its current phase:

- ``new``/``headers``: the request line and headers must be complete within ``header_timeout_s`` of the
  connection (or of the first byte after a keep-alive pause), however slowly they drip in (408, closed);
- ``body``: the body must be complete within ``body_timeout_s`` of the headers and no gap between its bytes may
  exceed ``body_idle_s`` (408, closed; the application reads a disconnect);
- ``idle`` (between keep-alive requests): uvicorn's keep-alive timer (``keep_alive_s``), closed silently;
- ``busy`` (the whole request is in, the application works on it): no deadline of the transport, except that an
  answer the client stops reading (the write buffer stays full) must drain within ``body_timeout_s`` (closed).

At most ``max_connections`` connections are open (``connection_cap`` keeps it below the process's file-descriptor
limit). One more evicts the open connection that has been waiting longest without a complete request (new or in
its headers first, then keep-alive idle, then in a body), so that slow clients cannot starve the trainer; when
every connection has a complete request in work the newcomer gets 503. Malformed requests get a JSON 400, and the
event loop's accept errors and uvicorn's per-request warnings are logged at most a few times per minute.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import time
from typing import ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from grpokit.errors import ConfigError
from grpokit.server.options import TransportLimits

logger = logging.getLogger(__name__)
BACKLOG = 64  # listen backlog; asyncio accepts up to this many connections per wake-up
FD_RESERVE = 64  # descriptors kept free beside the connections and accept bursts (logs, model files, threads)
LOG_WINDOW_S = 60.0
LOG_PER_WINDOW = 3


def open_fds() -> int:
    """Descriptors this process holds now (Linux /proc; elsewhere a small guess)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 32


def connection_cap(requested: int) -> int:
    """The most connections to keep open: ``requested`` (0: as many as fit), below the soft RLIMIT_NOFILE minus the
    descriptors open now, two accept bursts (one accepted over the cap, one whose evicted connections are still
    closing) and a reserve; ConfigError when fewer than 16 fit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    fit = (soft if soft != resource.RLIM_INFINITY else 1 << 20) - open_fds() - 2 * BACKLOG - FD_RESERVE
    if fit < 16:
        raise ConfigError(
            f"the file-descriptor limit ({soft}) leaves room for {max(fit, 0)} connections; raise it "
            f"(ulimit -n {soft + 1024}) before starting grpokit rollout"
        )
    if requested > fit:
        logger.warning(
            "--max_connections %d: only %d fit below the file-descriptor limit %d; serving at most %d",
            requested,
            fit,
            soft,
            fit,
        )
    return min(requested, fit) if requested > 0 else fit


def raw_error(status: int, reason: str, message: str) -> bytes:
    """A complete JSON error answer that closes the connection, written without h11 (whatever state it is in)."""
    body = json.dumps({"error": message}).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode() + body


class Throttle:
    """At most ``per_window`` events of one key per ``window_s``; the next allowed one reports how many were
    dropped."""

    def __init__(self, window_s: float = LOG_WINDOW_S, per_window: int = LOG_PER_WINDOW) -> None:
        self.window_s, self.per_window = window_s, per_window
        self._seen: dict[str, list] = {}  # key -> [window start, count in window, dropped]

    def allow(self, key: str) -> tuple[bool, int]:
        now = time.monotonic()
        entry = self._seen.setdefault(key[:200], [now, 0, 0])
        if now - entry[0] >= self.window_s:
            entry[0], entry[1] = now, 0
        if entry[1] >= self.per_window:
            entry[2] += 1
            return False, 0
        entry[1] += 1
        dropped, entry[2] = entry[2], 0
        if len(self._seen) > 256:  # keys are messages: bounded anyway, but never let them grow
            self._seen = {key[:200]: entry}
        return True, dropped


class ThrottledLogFilter(logging.Filter):
    """A logging filter keeping at most a few records of each message template per minute."""

    def __init__(self) -> None:
        super().__init__()
        self.throttle = Throttle()

    def filter(self, record: logging.LogRecord) -> bool:
        ok, dropped = self.throttle.allow(f"{record.name}:{record.msg}")
        if ok and dropped:
            record.msg = f"{record.msg} ({dropped} more like it not logged)"
        return ok


_PHASE_RANK = {"new": 0, "headers": 0, "idle": 1, "body": 2}  # eviction order; "busy" is never evicted


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under the phase deadlines and connection cap of the module docstring. A subclass
    with ``limits`` set is made by ``protocol_class``."""

    limits: ClassVar[TransportLimits] = TransportLimits()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._phase = "new"
        self._since = self._last_data = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

    # phases and their deadline ---------------------------------------------------------------------------------
    def _enter(self, phase: str, timeout_s: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = phase
        self._since = self._last_data = time.monotonic()
        if timeout_s is not None:
            self._timer = self.loop.call_later(timeout_s, self._on_deadline)

    def _on_deadline(self) -> None:
        self._timer = None
        if self.transport is None or self.transport.is_closing():
            return
        if self._phase == "body":
            now = time.monotonic()
            left = min(self._since + self.limits.body_timeout_s, self._last_data + self.limits.body_idle_s) - now
            if left > 0:
                self._timer = self.loop.call_later(left, self._on_deadline)
                return
            self._expire(
                f"the request body did not arrive within the server's deadline (all of it within "
                f"{self.limits.body_timeout_s:g}s, no pause over {self.limits.body_idle_s:g}s)"
            )
        elif self._phase in ("new", "headers"):
            self._expire(f"the request line and headers did not arrive within {self.limits.header_timeout_s:g}s")

    def _expire(self, message: str | None) -> None:
        """Close this connection; a 408 first when a request was under way and its answer has not started."""
        if self.transport is None or self.transport.is_closing():
            return
        cycle = self.cycle if self._phase == "body" else None
        if message is not None and self._phase != "idle" and (cycle is None or not cycle.response_started):
            self.transport.write(raw_error(408, "Request Timeout", message))
        if cycle is not None:  # the application's next receive() reads a disconnect; its answer is dropped
            cycle.disconnected = True
            cycle.message_event.set()
        self._enter("closed", None)
        self.transport.close()

    def _sync_phase(self) -> None:
        """Follow h11's view of the client: headers complete → body (if any) → busy."""
        state = self.conn.their_state
        if state is h11.SEND_BODY and self._phase in ("new", "headers", "idle"):
            self._enter("body", min(self.limits.body_timeout_s, self.limits.body_idle_s))
        elif state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR) and self._phase not in ("busy", "closed"):
            self._enter("busy", None)

    # asyncio.Protocol / uvicorn hooks --------------------------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._enter("new", self.limits.header_timeout_s)
        if len(self.connections) > self.limits.max_connections:
            victim = self._victim()
            if victim is None:
                self.transport.write(
                    raw_error(
                        503,
                        "Service Unavailable",
                        f"the server holds its limit of "
                        f"{self.limits.max_connections} connections, each with a request in "
                        "work; retry later",
                    )
                )
                self._enter("closed", None)
                self.transport.close()
                return
            victim._expire(
                None
                if victim._phase == "idle"
                else "closed to make room for a new connection (the "
                "server's connection limit is reached and this request was the slowest to arrive)"
            )

    def _victim(self) -> GuardedH11Protocol | None:
        best, best_key = None, None
        for c in self.connections:
            if c is self or not isinstance(c, GuardedH11Protocol) or c._phase not in _PHASE_RANK:
                continue
            if c.transport is None or c.transport.is_closing():
                continue
            key = (_PHASE_RANK[c._phase], c._since)
            if best_key is None or key < best_key:
                best, best_key = c, key
        return best

    def data_received(self, data: bytes) -> None:
        if self._phase == "idle":  # the next request starts: its headers are under the header deadline
            self._enter("headers", self.limits.header_timeout_s)
        elif self._phase == "new":
            self._phase = "headers"  # the deadline runs from the connection, not from its first byte
        self._last_data = time.monotonic()
        super().data_received(data)
        if self._phase != "closed":
            self._sync_phase()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._phase == "closed" or self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
            self._enter("idle", None)  # uvicorn's keep-alive timer closes it
        else:
            self._sync_phase()

    def pause_writing(self) -> None:
        """The client does not read its answer fast enough: it has ``body_timeout_s`` to drain it."""
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.body_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_stalled(self) -> None:
        self._write_timer = None
        if self.transport is not None:  # a closing transport too: a graceful close would wait on the client
            if self.cycle is not None:
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            self._enter("closed", None)
            self.transport.abort()  # its buffered answer is dropped: the client was not reading it
        self.flow.resume_writing()  # wakes a send() waiting to drain; it sees the disconnect

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._timer, self._write_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._write_timer = None
        self._phase = "closed"
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (bad request line or headers, headers over 16 KiB): JSON 400, closed."""
        self.transport.write(
            raw_error(
                400,
                "Bad Request",
                "malformed HTTP request (request line or headers); send HTTP/1.1 with headers under 16 KiB",
            )
        )
        self._enter("closed", None)
        self.transport.close()


def protocol_class(limits: TransportLimits) -> type[GuardedH11Protocol]:
    return type("GuardedH11ProtocolWithLimits", (GuardedH11Protocol,), {"limits": limits})


class _QuietLoopErrors:
    """The event loop's exception handler: accept errors (EMFILE and the like) and other loop errors logged at most
    a few times per minute each, with the count of those left out."""

    def __init__(self) -> None:
        self.throttle = Throttle()

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        ok, dropped = self.throttle.allow(str(context.get("message", "")))
        if not ok:
            return
        if dropped:
            context = {**context, "message": f"{context.get('message')} ({dropped} more like it not logged)"}
        loop.default_exception_handler(context)


class GuardedServer(uvicorn.Server):
    """uvicorn's server with the quiet loop exception handler installed."""

    async def serve(self, sockets=None) -> None:
        asyncio.get_running_loop().set_exception_handler(_QuietLoopErrors())
        await super().serve(sockets)


def server_config(app, host: str, port: int, limits: TransportLimits, **kwargs) -> uvicorn.Config:
    """uvicorn's config for ``app`` with the guarded protocol (``kwargs``: further uvicorn options)."""
    _quiet_uvicorn_logs()
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_class(limits),
        backlog=BACKLOG,
        timeout_keep_alive=max(1, round(limits.keep_alive_s)),
        ws="none",
        **kwargs,
    )


def _quiet_uvicorn_logs() -> None:
    for name in ("uvicorn.error", "asyncio"):
        log = logging.getLogger(name)
        if not any(isinstance(f, ThrottledLogFilter) for f in log.filters):
            log.addFilter(ThrottledLogFilter())


def serve(app, host: str, port: int, limits: TransportLimits) -> None:
    """Serve ``app`` until interrupted."""
    config = server_config(app, host, port, limits, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    GuardedServer(config).run()
