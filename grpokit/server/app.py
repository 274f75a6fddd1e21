"""The rollout server's HTTP API (FastAPI). Endpoint names follow ms-swift's ``swift rollout``.

``GET /health/``, ``GET /get_engine_type/``, ``POST /infer/`` (trajectories through the server's scheduler),
``POST /init_communicator/``, ``POST /update_weights/``, ``POST /check_weights/``, ``POST /probe/`` (the check's
greedy probe), ``POST /close_communicator/``, ``POST /reset_prefix_cache/``, ``POST /claim/`` and
``POST /release/`` (one trainer per server: server/claim.py); ``GET /openapi.json`` describes them; ms-swift's
route set and bodies beside them (server/swift_routes.py). Every error answer is JSON ``{"error": one line, ...}``
with a 4xx/5xx status (grpokit/server/errors.py), no bad request stops the server, and
an ``/infer/`` call whose client disconnects is cancelled (its rows stop at the next token).
"""

from __future__ import annotations

import asyncio
import logging
import os

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from grpokit.agents.service import ChatService
from grpokit.engines.partial.pause import PROBING, paused
from grpokit.errors import GrpokitError
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.server import adapter_updates
from grpokit.server.bodies import InferBody, ProbeBody
from grpokit.server.calls import CLIENT_GONE, admitted, until_disconnect
from grpokit.server.claim import ClaimMiddleware, Claims, add_claim_routes
from grpokit.server.errors import ErrorMiddleware, error_body, install_error_handlers
from grpokit.server.guard import GuardPolicy
from grpokit.server.hosts import HostPolicy
from grpokit.server.json_route import BoundedJsonRoute
from grpokit.server.media import ImageRefused, output_to_wire, take_images
from grpokit.server.openai_routes import OpenAIErrors, add_openai_routes
from grpokit.server.score_route import add_score_route
from grpokit.server.state import ServerState
from grpokit.server.surface import hardened
from grpokit.server.swift_routes import SwiftDispatch, add_swift_routes
from grpokit.server.weight_sync import RendezvousBusy, check_held
from grpokit.template.processor import is_vlm_folder
from grpokit.wire.bodies import CheckWeightsBody, InitCommunicatorBody, UpdateWeightsBody, check_bucket_sizes

MAX_MESSAGE_EXTRA_CHARS = 65536  # a message's fields beside role and content (tool_calls, name, ...), all together
MAX_CALL_EXTRA_CHARS = 4 << 20  # the same over every message of one /infer/ call (each is echoed back twice)

logger = logging.getLogger(__name__)
PEER_FAILED = 424  # Failed Dependency: the weight-sync peer (the trainer's store or group) failed, not this server


def create_app(state: ServerState) -> ErrorMiddleware:
    """The ASGI application serving ``state``: error net → OpenAI error shape (/v1) → API-key/body-size guard →
    FastAPI app."""
    # redirect_slashes off: Starlette's redirect of /infer to /infer/ builds its Location from the Host header
    app = FastAPI(
        title="grpokit rollout server",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        redirect_slashes=False,
    )
    app.router.route_class = BoundedJsonRoute  # bodies parsed within bounds (server/json_route.py)
    app.state.server = state
    install_error_handlers(app)
    _add_infer_routes(app, state)
    _add_weight_routes(app, state)
    if not state.multimodal:  # the OpenAI-compatible endpoint serves text (docs/agents.md)
        name = state.options.served_model_name or os.path.basename(os.path.normpath(state.options.model))
        add_openai_routes(
            app,
            ChatService(
                state.engine,
                name,
                context=getattr(state.engine, "max_model_len", None),
                max_n=state.options.max_batch_requests,
            ),
            state,  # /v1 counted against --max_inflight_requests and cancelled on disconnect, like /infer/
        )
    _add_check_route(app, state)
    add_score_route(app, state)  # a distillation teacher's scores (server/score_route.py)
    claims = Claims()  # one trainer per server (server/claim.py): its routes, and its check inside the guard
    add_claim_routes(app, claims)
    app.add_middleware(ClaimMiddleware, claims=claims)
    swift = add_swift_routes(app, state, serve_infer)  # ms-swift's route set and bodies beside grpokit's
    # every surface's layers (/v1: OpenAI's error shape); SwiftDispatch sends ms-swift-shaped bodies of shared
    # paths to their /swift routes
    return hardened(SwiftDispatch(app, swift), guard_policy(state), OpenAIErrors)


def guard_policy(state: ServerState) -> GuardPolicy:
    """The guard's view of the options: key, body size, allowed hosts, JSON item budgets and the longest string
    (a base64 image at --max_image_mb, at least 4 MiB: no prompt that fits a context is longer); the weight
    metadata's budget follows from the served model's tensor count (a tensor's metadata is at most 20 items)."""
    o = state.options
    count = getattr(state.engine, "tensor_count", None)
    path_items, hints = {}, {}
    if callable(count):
        n = count()
        path_items["/update_weights/"] = 20 * n + 16
        hints["/update_weights/"] = f"the served model has {n} tensors, so its metadata holds fewer items"
        path_items["/check_weights/"] = 16 * n + 16  # a tensor's sums: its list, dict, keys and values, 12 items
        hints["/check_weights/"] = f"the served model has {n} tensors, so its checksums hold fewer items"
    longest = max(4 << 20, -(-int(o.max_image_mb * 2**20) * 4 // 3) + 1024)  # a base64 image at --max_image_mb
    return GuardPolicy(
        api_key=o.api_key,
        max_body_bytes=o.max_body_bytes,
        hosts=HostPolicy.for_bind(o.host, o.allowed_hosts),
        max_json_items=o.max_json_items,
        max_json_string=longest,
        path_items=path_items,
        item_hints=hints,
    )


def _add_infer_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health/")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/get_engine_type/")
    async def get_engine_type() -> dict:
        return state.engine_info()

    @app.post("/infer/")
    async def infer(body: InferBody, request: Request) -> JSONResponse:
        return await serve_infer(state, body, request, output_to_wire)


async def serve_infer(state: ServerState, body: InferBody, request: Request, answer) -> JSONResponse:
    """One /infer/ call through the server's limits and scheduler; ``answer`` writes each trajectory's JSON (grpokit's
    shape, or ms-swift's: server/swift_routes.py)."""
    n = len(body.requests)
    check_infer_body(body, state.options.max_batch_requests)
    with admitted(state, n):  # 429 past --max_inflight_requests, before any work
        if n == 0:
            return JSONResponse([])
        _refuse_images_of_text_model(state, body)
        await _take_images(state, body)
        try:
            work = state.scheduler.async_infer(body.requests, body.request_config)
            outputs = await until_disconnect(request, work)
        except ValueError as e:  # includes ConfigError: the request asks for something this server cannot do
            raise HTTPException(400, f"{type(e).__name__}: {e}") from e
        except GrpokitError as e:  # a scheduler, environment or engine broke the rollout
            raise HTTPException(500, f"{type(e).__name__}: {e}") from e
    if outputs is None:
        return JSONResponse(error_body("the client disconnected; its requests were cancelled"), status_code=CLIENT_GONE)
    return JSONResponse([answer(o) for o in outputs])


def _refuse_images_of_text_model(state: ServerState, body: InferBody) -> None:
    """A text-only server refuses image requests before decoding anything (400)."""
    if state.multimodal:
        return
    i = next((i for i, r in enumerate(body.requests) if r.images), None)
    if i is None:
        return
    if state.options.engine == "vllm" and is_vlm_folder(state.options.model):
        raise HTTPException(
            400,
            f"requests[{i}].images: the vLLM engine takes images of Idefics3 models only "
            f"(docs/vllm.md), not of {state.options.model}; serve it with --engine "
            "transformers",
        )
    raise HTTPException(
        400,
        f"requests[{i}].images: this server serves a text-only model "
        f"({state.options.model}); serve a vision-language model for image requests",
    )


async def _take_images(state: ServerState, body: InferBody) -> None:
    """The requests' images decoded into their data_dicts (server/media.py), off the event loop; 4xx if refused."""
    try:
        await asyncio.to_thread(take_images, body.requests, state.image_limits)
    except ImageRefused as e:
        raise HTTPException(e.status, str(e)) from e


def check_infer_body(body: InferBody, max_batch_requests: int) -> None:
    """Limits the models cannot express: requests per call, and one trajectory per request (``n`` = 1), in the
    call's config and in each request's own."""
    n = len(body.requests)
    if n > max_batch_requests:
        raise HTTPException(
            413, f"{n} requests in one call exceed --max_batch_requests {max_batch_requests}; split the batch"
        )
    call_extra = 0
    for i, r in enumerate(body.requests):
        if r.request_config is not None and r.request_config.n != 1:
            raise HTTPException(
                400,
                f"requests[{i}].request_config.n {r.request_config.n}: the server samples one "
                "trajectory per request (n = 1); repeat the request instead",
            )
        for k, m in enumerate(r.messages):
            extra = [key for key in m if key not in ("role", "content")]
            if not extra:
                continue
            chars = bounded_chars([m[key] for key in extra], MAX_MESSAGE_EXTRA_CHARS)
            call_extra += chars
            if chars > MAX_MESSAGE_EXTRA_CHARS:
                raise HTTPException(
                    413,
                    f"requests[{i}].messages[{k}]: its fields beside role and content "
                    f"({', '.join(map(str, extra))[:80]}) hold more than "
                    f"{MAX_MESSAGE_EXTRA_CHARS} characters; the server echoes messages back, "
                    "so send less",
                )
            if call_extra > MAX_CALL_EXTRA_CHARS:
                raise HTTPException(
                    413,
                    f"requests[{i}].messages[{k}]: the call's message fields beside role and "
                    f"content hold more than {MAX_CALL_EXTRA_CHARS} characters (each is echoed "
                    "back); send fewer per call",
                )


def bounded_chars(value, limit: int) -> int:
    """Characters of the strings (keys included) and one per other value inside ``value``, counted until past
    ``limit`` (the protocol already bounds the nesting)."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            total += len(v)
            for key, item in v.items():
                total += len(key) if isinstance(key, str) else 1
                stack.append(item)
        elif isinstance(v, list):
            total += len(v)
            stack.extend(v)
        else:
            total += 1
    return total


def _add_weight_routes(app: FastAPI, state: ServerState) -> None:
    opts = state.options

    @app.post("/init_communicator/")
    async def init_communicator(body: InitCommunicatorBody) -> dict:
        device = getattr(state.engine, "device", None)
        if body.backend == "nccl" and (device is None or device.type != "cuda"):
            raise HTTPException(
                422, f"backend nccl needs the served model on a GPU; this server runs on {device}; use backend gloo"
            )
        try:
            await asyncio.to_thread(state.receiver.open, body, device)
        except RendezvousBusy as e:
            raise HTTPException(429, str(e), headers={"Retry-After": "5"}) from e
        except GrpokitError as e:  # the store the body names did not answer, or refused
            raise HTTPException(PEER_FAILED, str(e)) from e
        return {"ok": True, "group": body.group, "timeout_s": state.receiver.timeout_for(body)}

    @app.post("/update_weights/")
    async def update_weights(body: UpdateWeightsBody) -> dict:
        metas = [m for b in body.buckets for m in b.tensors]
        count = getattr(state.engine, "tensor_count", None)
        if callable(count) and len(metas) > count():
            raise HTTPException(
                422, f"cannot load the weights: {len(metas)} tensors announced, the served model has {count()}"
            )
        problems = check_bucket_sizes(body, int(opts.max_weight_bucket_mb * 1024 * 1024))
        problems += state.engine.check_weights(metas) + adapter_updates.refusal(state.engine, body)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise HTTPException(422, f"cannot load the weights: {problems[0]}{more}")
        if body.dry_run:
            return {"ok": True, "group": state.receiver.group, **adapter_updates.held_base(state.engine)}
        if not state.receiver.is_open:
            raise HTTPException(409, "no weight-sync group: POST /init_communicator/ first")

        try:
            loaded = await asyncio.to_thread(_receive, state, body)
        except adapter_updates.AdapterUpdateError as e:  # the version in service stays; the group stays open
            raise HTTPException(422, f"cannot load the adapter: {e}") from e
        except GrpokitError as e:  # the trainer's end of the group failed or went away
            raise HTTPException(PEER_FAILED, f"{e}; the weight-sync group is closed, the trainer re-creates it") from e
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


def _receive(state: ServerState, body: UpdateWeightsBody) -> int:
    """Load one update's buckets under the engine's lock. With ``interrupt`` (--partial_rollouts), the generation
    running now stops at its next token and hands the lock over, and continues once the weights are in."""
    pausing = body.interrupt and hasattr(state.engine, "pause_for_update")
    if pausing:
        state.engine.pause_for_update()
    try:
        with state.engine.lock:  # sampling waits until every bucket is in
            adapter_updates.begin(state.engine, body, state.weight_version + 1)
            try:
                loaded = state.receiver.receive(body, state.engine.load_weights)
            except BaseException:  # some tensors may be new: no version describes them (server/calls.py: 503)
                adapter_updates.end(state.engine, body, ok=False)
                state.engine.mark_weights_incomplete(body.adapter is None or body.adapter.base)
                raise
            adapter_updates.end(state.engine, body, ok=True)
            state.engine.mark_weights_incomplete(False)
            state.engine.reset_prefix_cache()
            state.engine.set_policy_version(body.version)  # the samples' tag from now on; None: unknown
            return loaded
    finally:
        if pausing:  # loaded or not: paused rows continue (on the new weights when they came)
            state.engine.resume_after_update()


def _add_check_route(app: FastAPI, state: ServerState) -> None:
    """``POST /check_weights/`` (``--check_weight_sync`` on the trainer; docs/server_mode.md, "Weight sync")."""

    @app.post("/check_weights/")
    async def check_weights(body: CheckWeightsBody) -> dict:
        """After a sync: the trainer's checksums of what it sent against the weights the engine now holds."""
        count = getattr(state.engine, "tensor_count", None)
        n = sum(len(b) for b in body.buckets)
        if callable(count) and n > count():
            raise HTTPException(422, f"cannot check the weights: {n} tensors listed, the served model has {count()}")
        if not hasattr(state.engine, "weight_sums"):
            raise HTTPException(
                501,
                f"the {state.options.engine} engine cannot read its weights back; run the "
                "trainer with --check_weight_sync false",
            )
        if body.weight_version is not None and body.weight_version != state.weight_version:
            return {
                "ok": False,
                "count": 1,
                "checked": 0,
                "unreadable": 0,
                "problems": [
                    f"another sync (weight version {state.weight_version}) replaced version "
                    f"{body.weight_version} before the check; is a second trainer syncing?"
                ],
            }

        def check() -> dict:
            # no sync loads while the weights are read back; a generation running pauses (partial rollouts)
            with paused(state.engine), state.engine.lock:
                return check_held(body, state.engine.weight_sums)

        return await asyncio.to_thread(check)

    @app.post("/probe/")
    async def probe(body: ProbeBody) -> dict:
        """The check's greedy probe after a sync, on the new weights and before rows paused by the update go
        on (a plain /infer/ call would queue behind the rollout in flight)."""
        request = RolloutInferRequest(messages=[{"role": "user", "content": body.prompt}])
        config = RequestConfig(max_tokens=body.max_tokens, temperature=0, logprobs=True)

        def run() -> dict:
            token = PROBING.set(True)
            try:
                with paused(state.engine):
                    return state.engine.infer([request], config)[0].model_dump(mode="json")
            finally:
                PROBING.reset(token)

        try:
            with admitted(state, 1):  # counted like any generation (and refused on incomplete weights)
                return await asyncio.to_thread(run)
        except ValueError as e:  # includes ConfigError: e.g. a prompt longer than the context
            raise HTTPException(400, f"{type(e).__name__}: {e}") from e
