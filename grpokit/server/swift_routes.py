"""ms-swift 4.x's rollout routes on ``grpokit rollout``, beside grpokit's own, so that ``swift rlhf --vllm_mode
server`` (its ``VLLMClient``) trains against this server unchanged. Same guard (API key, body size, JSON budgets),
same error shape, same limits as grpokit's routes.

- ``GET /health`` (and grpokit's ``/health/``), ``POST /get_engine_type/`` (ms-swift's four keys; grpokit's GET
  answers grpokit's), ``GET /get_world_size/`` (1: one server rank), ``GET /get_model_state_keys/``,
  ``POST /reset_mm_cache/`` and ``/reset_encoder_cache/`` (nothing is cached across calls: answered true);
- ``POST /infer/`` with ms-swift's ``infer_requests`` body, answered in ms-swift's ``RolloutOutput`` shape
  (grpokit/engines/swift_protocol.py); ``POST /init_communicator/`` with ms-swift's ``{host, port, world_size}``,
  where this server hosts the group (grpokit/server/swift_weights.py). Both paths are shared with grpokit's
  bodies: ``SwiftDispatch`` sends a body of ms-swift's shape to ``/swift/infer/`` or ``/swift/init_communicator/``
  (which may also be called directly), and ``POST /close_communicator/`` closes both kinds of group;
- ``POST /update_named_param/``, ``/update_flattened_params/`` (ms-swift's bucket metadata),
  ``/process_weights_after_loading/``; ``/update_adapter_flattened_param/`` (a LoRA adapter, server/swift_adapter.py;
  ``get_engine_type`` says ``enable_lora: true`` where the engine serves adapters, --vllm_enable_lora).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
from concurrent.futures import TimeoutError as FutureTimeout

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from grpokit.engines.swift_protocol import SwiftRefused, grpokit_config, grpokit_request, swift_answer
from grpokit.errors import ServerError
from grpokit.server.bodies import InferBody
from grpokit.server.media import output_to_wire
from grpokit.server.swift_adapter import add_adapter_routes
from grpokit.server.swift_weights import QueueFull, SwiftWeightGroup, tensor_metas
from grpokit.wire.swift import SwiftFlattenedBody, SwiftInferBody, SwiftInitCommunicatorBody, SwiftNamedParamBody
from grpokit.wire.swift_group import WILDCARDS

PEER_FAILED = 424  # as grpokit's weight routes: the trainer's side of the group failed, not this server
SHARED = {"/infer/": b'"infer_requests"', "/init_communicator/": None}  # paths whose body shape picks the route


class SwiftDispatch:
    """ASGI layer between the guard (which has read the body) and the app: a POST to a shared path whose JSON body
    has ms-swift's shape goes to that path under ``/swift``; ``/close_communicator/`` too while an ms-swift group
    is held."""

    def __init__(self, app, group: SwiftWeightGroup) -> None:
        self.app, self.group = app, group

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in (*SHARED, "/close_communicator/"):
            await self.app(scope, receive, send)
            return
        if path == "/close_communicator/":
            swift = self.group.opened
            chunks = []
        else:
            chunks = [await receive()]
            while chunks[-1].get("more_body"):
                chunks.append(await receive())
            swift = _swift_shaped(path, b"".join(c.get("body", b"") for c in chunks))
        if swift:
            scope = {**scope, "path": "/swift" + path, "raw_path": ("/swift" + path).encode()}
        pending = list(chunks)

        async def replay():
            return pending.pop(0) if pending else await receive()

        await self.app(scope, replay if chunks else receive, send)


def _swift_shaped(path: str, body: bytes) -> bool:
    """ms-swift's body: ``infer_requests`` (grpokit's is ``requests``), or a group body without grpokit's
    ``rank`` and ``group`` (ms-swift's server picks ranks itself)."""
    marker = SHARED[path]
    if marker is not None and marker not in body:
        return False
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return False  # the app answers the parse error in grpokit's shape
    if not isinstance(data, dict):
        return False
    if path == "/infer/":
        return "infer_requests" in data and "requests" not in data
    return "rank" not in data and "group" not in data and "world_size" in data


def add_swift_routes(app: FastAPI, state, serve_infer) -> SwiftWeightGroup:
    """Register ms-swift's routes on ``app``; ``serve_infer`` is the server's /infer/ path (server/app.py).
    Returns the weight group that ``SwiftDispatch`` consults."""
    group = SwiftWeightGroup(state)
    model = state.options.served_model_name or os.path.basename(os.path.normpath(state.options.model))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.post("/get_engine_type/")
    async def get_engine_type() -> dict:
        multi_turn = bool(state.options.multi_turn_scheduler)
        return {
            "engine_type": "AsyncLLMEngine" if multi_turn else "LLMEngine",  # ms-swift's multi-turn runs async
            "enable_multi_turn": multi_turn,
            "use_gym_env": bool(state.options.gym_env),
            "enable_lora": getattr(state.engine, "adapters", None) is not None,  # server/swift_adapter.py
        }

    @app.get("/get_world_size/")
    async def get_world_size() -> dict:
        return {"world_size": 1}

    @app.get("/get_model_state_keys/")
    async def get_model_state_keys() -> dict:
        keys = getattr(state.engine, "state_keys", None)
        return {"keys": keys() if callable(keys) else []}

    for cache in ("mm", "encoder"):
        app.post(f"/reset_{cache}_cache/")(_reset(cache))

    @app.post("/swift/infer/")
    async def infer(body: SwiftInferBody, request: Request) -> JSONResponse:
        try:
            config = grpokit_config(body.request_config)
            requests = [grpokit_request(r, f"infer_requests[{i}]") for i, r in enumerate(body.infer_requests)]
        except SwiftRefused as e:
            raise HTTPException(400, str(e)) from e
        inner = InferBody(requests=requests, request_config=config)
        multi_turn = bool(state.options.multi_turn_scheduler)
        return await serve_infer(state, inner, request, lambda o: swift_answer(output_to_wire(o), model, multi_turn))

    _add_group_routes(app, state, group)
    _add_weight_routes(app, state, group)
    return group


def _reset(cache: str):
    async def reset() -> dict:
        return {"message": f"Request received, resetting {cache} cache status: True"}

    reset.__name__ = f"reset_{cache}_cache"
    return reset


def _add_weight_routes(app: FastAPI, state, group: SwiftWeightGroup) -> None:
    opts = state.options

    def check(metas, nbytes: int | None = None) -> None:
        if not group.opened:
            raise HTTPException(409, "no weight-sync group: POST /init_communicator/ first")
        limit = int(opts.max_weight_bucket_mb * 1024 * 1024)
        if nbytes is not None and len(metas) > 1 and nbytes > limit:
            raise HTTPException(
                422,
                f"a bucket of {nbytes} bytes with {len(metas)} tensors exceeds --max_weight_bucket_mb "
                f"{opts.max_weight_bucket_mb:g}; lower the trainer's bucket size or raise the server's limit",
            )
        problems = state.engine.check_weights(metas)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise HTTPException(422, f"cannot load the weights: {problems[0]}{more}")

    def queue(body) -> None:
        try:
            group.receive(body)
        except QueueFull as e:
            raise HTTPException(429, str(e), headers={"Retry-After": "5"}) from e

    @app.post("/update_named_param/")
    async def update_named_param(body: SwiftNamedParamBody) -> dict:
        check(tensor_metas(body))
        queue(body)
        return {"message": "Request received, updating named parameter"}

    @app.post("/update_flattened_params/")
    async def update_flattened_params(body: SwiftFlattenedBody) -> dict:
        check(tensor_metas(body), body.metadatas[-1].end_idx)
        queue(body)
        return {"message": "Request received, updating flattened parameters"}

    add_adapter_routes(app, state, group, check)


def _add_group_routes(app: FastAPI, state, group: SwiftWeightGroup) -> None:
    """ms-swift's group routes: the server hosts the group (init), waits for what was queued (process), closes."""
    opts = state.options

    @app.post("/swift/init_communicator/")
    async def init_communicator(body: SwiftInitCommunicatorBody, request: Request) -> dict:
        if body.world_size != 2:
            raise HTTPException(
                400,
                f"world_size {body.world_size}: this server is one rank (GET /get_world_size/ answers 1), so its "
                "group with the trainer has 2",
            )
        if body.host not in WILDCARDS and body.host != opts.host:
            raise HTTPException(
                400,
                f"host {body.host[:64]}: the group's store listens where this server listens ({opts.host}); send "
                f"{opts.host} or 0.0.0.0",
            )
        device = getattr(state.engine, "device", None)
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        if backend == "nccl" and importlib.util.find_spec("vllm") is None:
            raise HTTPException(
                501,
                "ms-swift's weight group on a GPU is vLLM's PyNcclCommunicator, and vLLM is not installed beside "
                "this server; pip install vllm, or use grpokit's own weight routes (grpokit train)",
            )
        group.open(opts.host, body.port, body.world_size, backend, device, request.scope["server"][0])
        return {"message": "Request received, initializing communicator"}

    @app.post("/process_weights_after_loading/")
    async def process_weights_after_loading() -> dict:
        timeout = opts.max_sync_timeout_s
        try:
            await asyncio.to_thread(group.finish, timeout)
        except FutureTimeout as e:
            raise HTTPException(504, f"the weight sync did not finish within --max_sync_timeout_s {timeout:g}") from e
        except ServerError as e:
            raise HTTPException(PEER_FAILED, str(e)) from e
        return {"message": "Weights processed after loading"}

    @app.post("/swift/close_communicator/")
    async def close_communicator() -> dict:
        await asyncio.to_thread(state.receiver.close)
        group.close()
        return {"message": "Request received, closing communicator"}
