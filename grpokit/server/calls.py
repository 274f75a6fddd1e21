"""Per-call controls every generation route of the rollout server shares (``/infer/``, ``/v1/chat/completions``):
the sequences a call asks for are counted against ``--max_inflight_requests`` (429 past it), nothing is sampled
after a weight update that failed halfway until a complete one arrives (503), and a call whose client
disconnects is cancelled (its rows stop at the next token)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterator

from fastapi import HTTPException, Request

from grpokit.server.engine import CANCEL

logger = logging.getLogger(__name__)
CLIENT_GONE = 499  # nginx's code for "client closed the request": nobody reads it, the log does


@contextlib.contextmanager
def admitted(state, n: int) -> Iterator[None]:
    """``n`` more sequences in flight on ``state`` while inside; 429 (Retry-After) when they would pass
    ``--max_inflight_requests``."""
    if getattr(state.engine, "weights_incomplete", False):
        raise HTTPException(
            503,
            "a weight update failed halfway: the served weights are no version the trainer sent; sampling "
            "resumes once a complete update arrives (the trainer re-creates the weight-sync group)",
            headers={"Retry-After": "5"},
        )
    limit = state.options.max_inflight_requests
    if state.inflight + n > limit:
        raise HTTPException(
            429,
            f"server busy: {state.inflight} requests in flight, {n} more would exceed "
            f"--max_inflight_requests {limit}; retry later",
            headers={"Retry-After": "1"},
        )
    state.inflight += n
    try:
        yield
    finally:
        state.inflight -= n


async def until_disconnect(request: Request, work):
    """Await ``work``; if the client disconnects first, cancel it and return None. The engine sees the cancel event
    through ``CANCEL`` (copied into the task's context), so generation for this call stops at the next token."""
    event = threading.Event()
    token = CANCEL.set(event)
    try:
        task = asyncio.ensure_future(work)  # the task copies the context, with this call's event
    finally:
        CANCEL.reset(token)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is stopping this request: same as a disconnect
        watcher.cancel()
        event.set()
        task.cancel()
        raise
    if task.done():
        watcher.cancel()
        return task.result()
    event.set()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    logger.info("%s: client disconnected; its requests were cancelled", request.url.path)
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
