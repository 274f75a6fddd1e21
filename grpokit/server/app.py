"""The rollout server's HTTP API (FastAPI). Endpoint names follow ms-swift's ``swift rollout``.

``GET /health/``, ``GET /get_engine_type/``, ``POST /infer/`` (trajectories through the server's scheduler),
``POST /init_communicator/``, ``POST /update_weights/``, ``POST /close_communicator/``,
``POST /reset_prefix_cache/``. Every error answer is JSON ``{"error": one line, ...}`` with a 4xx/5xx status, and
no bad request stops the server.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from grpokit.errors import GrpokitError
from grpokit.server.bodies import InferBody, InitCommunicatorBody, UpdateWeightsBody, error_body
from grpokit.server.guard import GuardMiddleware
from grpokit.server.state import ServerState

logger = logging.getLogger(__name__)


def _validation_message(errors: list[dict]) -> str:
    """One line out of pydantic's error list: the first problem, its location, and how many more."""
    if not errors:
        return "invalid request body"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"body is not valid JSON ({first.get('ctx', {}).get('error', first.get('msg'))})"
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{loc}: {first.get('msg', 'invalid')}{more}"


def _jsonable_errors(errors) -> list[dict]:
    return [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in errors]


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        return JSONResponse(status_code=422, content=error_body(_validation_message(errors),
                                                                detail=_jsonable_errors(errors)))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content=error_body(str(exc.detail)),
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(status_code=500, content=error_body(f"{type(exc).__name__}: {exc}"))


def create_app(state: ServerState) -> GuardMiddleware:
    """The ASGI application serving ``state``: the FastAPI app behind the API-key/body-size guard."""
    app = FastAPI(title="grpokit rollout server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    _install_error_handlers(app)
    opts = state.options

    @app.get("/health/")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/get_engine_type/")
    async def get_engine_type() -> dict:
        return state.engine_info()

    @app.post("/infer/")
    async def infer(body: InferBody) -> JSONResponse:
        n = len(body.requests)
        if n > opts.max_batch_requests:
            raise HTTPException(413, f"{n} requests in one call exceed --max_batch_requests "
                                     f"{opts.max_batch_requests}; split the batch")
        if state.inflight + n > opts.max_inflight_requests:
            raise HTTPException(429, f"server busy: {state.inflight} requests in flight, {n} more would exceed "
                                     f"--max_inflight_requests {opts.max_inflight_requests}; retry later",
                                headers={"Retry-After": "1"})
        if n == 0:
            return JSONResponse([])
        state.inflight += n
        try:
            outputs = await state.scheduler.async_infer(body.requests, body.request_config)
        except ValueError as e:  # includes ConfigError: the request asks for something this server cannot do
            raise HTTPException(400, f"{type(e).__name__}: {e}") from e
        except GrpokitError as e:  # a scheduler, environment or engine broke the rollout
            raise HTTPException(500, f"{type(e).__name__}: {e}") from e
        finally:
            state.inflight -= n
        return JSONResponse([o.model_dump(mode="json") for o in outputs])

    @app.post("/init_communicator/")
    async def init_communicator(body: InitCommunicatorBody) -> dict:
        if body.rank >= body.world_size:
            raise HTTPException(422, f"rank {body.rank} must be below world_size {body.world_size}")
        device = getattr(state.engine, "device", None)
        if body.backend == "nccl" and (device is None or device.type != "cuda"):
            raise HTTPException(422, "backend nccl needs the served model on a GPU; this server runs on "
                                     f"{device}; use backend gloo")
        try:
            await asyncio.to_thread(state.receiver.open, body, device)
        except GrpokitError as e:
            raise HTTPException(504, str(e)) from e
        return {"ok": True, "group": body.group}

    @app.post("/update_weights/")
    async def update_weights(body: UpdateWeightsBody) -> dict:
        problems = state.engine.check_weights([m for b in body.buckets for m in b.tensors])
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise HTTPException(422, f"cannot load the weights: {problems[0]}{more}")
        if body.dry_run:
            return {"ok": True, "group": state.receiver.group}
        if not state.receiver.is_open:
            raise HTTPException(409, "no weight-sync group: POST /init_communicator/ first")

        def receive() -> int:
            with state.engine.lock:  # sampling waits until every bucket is in
                loaded = state.receiver.receive(body, state.engine.load_weights)
                state.engine.reset_prefix_cache()
                return loaded

        try:
            loaded = await asyncio.to_thread(receive)
        except GrpokitError as e:
            raise HTTPException(500, f"{e}; the weight-sync group is closed, the trainer re-creates it") from e
        state.weight_version += 1
        return {"ok": True, "loaded": loaded, "weight_version": state.weight_version}

    @app.post("/close_communicator/")
    async def close_communicator() -> dict:
        await asyncio.to_thread(state.receiver.close)
        return {"ok": True}

    @app.post("/reset_prefix_cache/")
    async def reset_prefix_cache() -> dict:
        state.engine.reset_prefix_cache()
        return {"ok": True}

    return GuardMiddleware(app, opts.api_key, opts.max_body_bytes)
