"""One trainer per rollout server: a claim taken at the trainer's start, refused to a second trainer up front.

A trainer that syncs its weights into a server assumes that the server samples with its weights; two trainers on
one server would each train on the other's samples. So a grpokit trainer claims every server it uses before it
trains (``POST /claim/`` with its id, pid and host) and sends its id as the ``X-Grpokit-Trainer`` header on every
call. While a claim is held:

- ``/claim/`` from another id is refused (409) with one line naming the holder (pid, host) and when its claim
  expires;
- the calls that sample or change the served weights (``/infer/``, ``/init_communicator/``, ``/update_weights/``,
  ``/close_communicator/``, ``/reset_prefix_cache/``) from any other caller are refused (409) the same way, so a
  client that does not claim (an older grpokit, ms-swift's) cannot slip in beside the holder either. The
  OpenAI-compatible ``/v1`` routes, ``/health/``, ``/get_engine_type/`` and the weight check stay open.

The rule for a trainer that dies: a claim lasts ``LEASE_S`` seconds after the holder's last call to the server (any
call with its header renews it; the trainer also renews it every ``LEASE_S / 6`` seconds from a thread of its own,
so a long optimizer step does not lose it). A trainer that ends, also on an error, releases its claim
(``POST /release/``); one that is killed loses it ``LEASE_S`` seconds after its last call. Sooner where that can
be known: a trainer started on the holder's host that finds the holder's pid gone takes the claim over at once
(``replaces``: the holder's id, which the refusal names), and one elsewhere that finds the holder silent for
more than two renewals waits out the rest of the lease once and claims again. A server without claims (no
trainer, or only clients that never claim) serves everyone, as before.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from grpokit.engines.server_claim import CLAIM_HEADER
from grpokit.server.errors import error_body

LEASE_S = 30.0
CLAIMED_PATHS = frozenset(
    {"/infer/", "/init_communicator/", "/update_weights/", "/close_communicator/", "/reset_prefix_cache/"}
)
CONFLICT = 409


class ClaimBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    trainer: str = Field(min_length=8, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    pid: int = Field(default=0, ge=0, le=1 << 31)
    host: str = Field(default="", max_length=255)
    # the holder's id, from a trainer on the holder's host that found the holder's pid gone (killed): taken over
    replaces: str | None = Field(default=None, max_length=64)


@dataclass
class _Holder:
    trainer: str
    pid: int
    host: str
    seen: float  # clock() at its last call


class Claims:
    """The server's one claim (thread-safe: the routes and the middleware run on the event loop, tests anywhere)."""

    def __init__(self, lease_s: float = LEASE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s, self._clock = lease_s, clock
        self._holder: _Holder | None = None
        self._lock = threading.Lock()

    def _live(self) -> _Holder | None:
        if self._holder is not None and self._clock() - self._holder.seen > self.lease_s:
            self._holder = None  # its trainer stopped calling: expired
        return self._holder

    def claim(self, body: ClaimBody) -> dict | None:
        """Take or renew the claim for ``body.trainer`` (or take over the holder it ``replaces``); when another
        trainer holds it, the refusal: the error line and the holder (pid, host, seconds since its last call)."""
        with self._lock:
            holder = self._live()
            if holder is not None and body.trainer != holder.trainer and body.replaces != holder.trainer:
                idle = self._clock() - holder.seen
                return error_body(
                    self._refusal(holder, "this server is claimed by another trainer"),
                    holder={"trainer": holder.trainer, "pid": holder.pid, "host": holder.host, "idle_s": idle},
                    lease_s=self.lease_s,
                )
            self._holder = _Holder(body.trainer, body.pid, body.host, self._clock())
            return None

    def release(self, trainer: str) -> bool:
        with self._lock:
            if self._holder is not None and self._holder.trainer == trainer:
                self._holder = None
                return True
            return False

    def admit(self, trainer: str | None) -> str | None:
        """A call that samples or changes the weights from ``trainer`` (None: no header): renews the holder's
        claim; the refusal line when another trainer holds it."""
        with self._lock:
            holder = self._live()
            if holder is None:
                return None
            if trainer == holder.trainer:
                holder.seen = self._clock()
                return None
            return self._refusal(holder, "this server belongs to another trainer")

    def renew(self, trainer: str) -> None:
        with self._lock:
            holder = self._live()
            if holder is not None and holder.trainer == trainer:
                holder.seen = self._clock()

    def _refusal(self, holder: _Holder, what: str) -> str:
        left = max(0.0, self.lease_s - (self._clock() - holder.seen))
        who = f"pid {holder.pid}" + (f" on {holder.host}" if holder.host else "")
        return (
            f"{what} ({who}, trainer {holder.trainer[:12]}); one trainer per rollout server: start another server "
            f"for this run, or stop that trainer (its claim ends when it exits, or {left:.0f} s after its last "
            f"call if it was killed)"
        )


def add_claim_routes(app: FastAPI, claims: Claims) -> None:
    @app.post("/claim/", response_model=None)
    async def claim(body: ClaimBody) -> dict | JSONResponse:
        refusal = claims.claim(body)
        if refusal is not None:
            return JSONResponse(refusal, status_code=CONFLICT)
        return {"trainer": body.trainer, "lease_s": claims.lease_s}

    @app.post("/release/")
    async def release(body: ClaimBody) -> dict:
        return {"released": claims.release(body.trainer)}


class ClaimMiddleware:
    """Refuses the calls of ``CLAIMED_PATHS`` from anyone but the claim's holder, and renews the holder's claim
    on any call that carries its header."""

    def __init__(self, app, claims: Claims) -> None:
        self.app, self.claims = app, claims

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            trainer = next(
                (v.decode("latin-1") for k, v in scope.get("headers") or [] if k == CLAIM_HEADER.encode()), None
            )
            if scope.get("path") in CLAIMED_PATHS:
                refusal = self.claims.admit(trainer)
                if refusal is not None:
                    await _refuse(send, refusal)
                    return
            elif trainer is not None:
                self.claims.renew(trainer)
        await self.app(scope, receive, send)


async def _refuse(send, message: str) -> None:
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": CONFLICT, "headers": headers})
    await send({"type": "http.response.body", "body": body})
