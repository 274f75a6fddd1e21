"""The OpenAI-compatible endpoint: ``POST /v1/chat/completions`` and ``GET /v1/models``, and, where episodes are
recorded, the same two under ``/episodes/<id>/v1`` (the episode's key is its bearer token).

``grpokit rollout`` mounts the ``/v1`` routes beside its own (same API key, guard and bounds). Their errors carry
the server's one line in OpenAI's shape, ``{"error": {"message": line, "type": ..., "code": status}}``
(``OpenAIErrors`` rewrites every error answer under ``/v1`` and ``/episodes``, the guard's 401/413 included), so
the ``openai`` package puts the line in its exception's message. For the in-process engine the trainer starts
``LocalEndpoint``: the episode routes only, on 127.0.0.1, on the hardened transport (server/surface.py) in a thread
of its own. The body and the answer are grpokit/agents/chat.py's, the call itself grpokit/agents/service.py's.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from grpokit.agents.chat import ChatBody, ChatError, models_answer
from grpokit.agents.episodes import Episode, EpisodeRecorder
from grpokit.agents.service import ChatService
from grpokit.errors import RolloutError
from grpokit.server.calls import CLIENT_GONE, admitted, until_disconnect
from grpokit.server.errors import ErrorMiddleware, error_body, install_error_handlers
from grpokit.server.guard import GuardPolicy
from grpokit.server.json_route import BoundedJsonRoute
from grpokit.server.surface import BackgroundServer, hardened, shared_limits

logger = logging.getLogger(__name__)
LOCAL_BODY_BYTES = 32 << 20  # an episode's call: a long history, never images
UNKNOWN_KEY = secrets.token_urlsafe(32)  # compared against when the id names no episode


def add_openai_routes(app: FastAPI, service: ChatService, state=None) -> None:
    """``/v1/models`` and ``/v1/chat/completions`` on ``app`` (the server's guard applies its API key). With the
    server's ``state``, a call's ``n`` sequences count against --max_inflight_requests and a call whose client
    disconnects is cancelled, as on ``/infer/`` (server/calls.py)."""

    @app.get("/v1/models")
    async def models() -> dict:
        return models_answer(service.model_name)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatBody, request: Request) -> dict | JSONResponse:
        if state is None:
            return await _served(service, body, None)
        with admitted(state, body.n):
            answer = await until_disconnect(request, _served(service, body, None))
        if answer is None:
            return JSONResponse(error_body("the client disconnected; its call was cancelled"), status_code=CLIENT_GONE)
        return answer


def add_episode_routes(app: FastAPI, service: ChatService, recorder: EpisodeRecorder) -> None:
    """``/episodes/<id>/v1/models`` and ``/episodes/<id>/v1/chat/completions``: the calls of one episode, each
    recorded; the episode's key is the bearer token: an unknown id and a wrong key get the same 401."""

    def episode_of(episode_id: str, request: Request) -> Episode:
        """The open episode that this id and key name; one answer when either is wrong (nobody can tell an id
        that exists from one that does not)."""
        episode = recorder.get(episode_id)
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        key = episode.key if episode is not None else UNKNOWN_KEY  # the same comparison either way
        matches = hmac.compare_digest(token.strip().encode(), key.encode())
        if episode is None or scheme.lower() != "bearer" or not matches:
            raise HTTPException(
                401,
                "no open episode with this id and key: episodes are reached only while their agent runs, with the "
                "client the agent was given (its base_url and api_key)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return episode

    @app.get("/episodes/{episode_id}/v1/models")
    async def episode_models(episode_id: str, request: Request) -> dict:
        episode_of(episode_id, request)
        return models_answer(service.model_name)

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def episode_chat(episode_id: str, body: ChatBody, request: Request) -> dict:
        return await _served(service, body, episode_of(episode_id, request))


async def _served(service: ChatService, body: ChatBody, episode: Episode | None) -> dict:
    try:
        return await service.complete(body, episode)
    except ChatError as e:
        raise HTTPException(e.status, str(e)) from e
    except RolloutError as e:
        raise HTTPException(500, f"{type(e).__name__}: {e}") from e


OPENAI_PATHS = ("/v1/", "/episodes/")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    410: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def openai_error(body: bytes, status: int) -> bytes:
    """A JSON error answer ``{"error": line, ...}`` in OpenAI's shape (other bodies unchanged)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body
    if not isinstance(obj, dict) or not isinstance(obj.get("error"), str):
        return body
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return json.dumps({"error": {"message": obj["error"], "type": kind, "param": None, "code": str(status)}}).encode()


class OpenAIErrors:
    """ASGI wrapper: error answers of the OpenAI paths take OpenAI's shape (``openai_error``)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith(OPENAI_PATHS):
            await self.app(scope, receive, send)
            return
        held: dict = {}
        chunks: list[bytes] = []

        async def shaping_send(message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held["start"] = message
                return
            if "start" not in held or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            start = held.pop("start")
            body = openai_error(b"".join(chunks), start["status"])
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, shaping_send)


def episode_app(service: ChatService, recorder: EpisodeRecorder) -> ErrorMiddleware:
    """The ASGI application of the episode routes: error net → OpenAI error shape → body-size guard → FastAPI."""
    app = FastAPI(
        title="grpokit episodes", docs_url=None, redoc_url=None, openapi_url="/openapi.json", redirect_slashes=False
    )
    app.router.route_class = BoundedJsonRoute  # bodies parsed within bounds (server/json_route.py)
    install_error_handlers(app)
    add_episode_routes(app, service, recorder)
    policy = GuardPolicy(api_key=None, max_body_bytes=LOCAL_BODY_BYTES, host_hint=" (the endpoint is local only)")
    return hardened(app, policy, OpenAIErrors)


class LocalEndpoint:
    """The episode routes over ``service`` on 127.0.0.1 (a free port), on the hardened transport in a daemon
    thread of the trainer (server/surface.py). ``url`` is its base (``http://127.0.0.1:PORT``); ``close()`` stops
    it."""

    def __init__(self, service: ChatService, recorder: EpisodeRecorder) -> None:
        self.service, self.recorder = service, recorder
        self._server = BackgroundServer(episode_app(service, recorder), shared_limits(), name="grpokit-episodes")
        self.port, self.url = self._server.port, self._server.url

    def base_url(self, episode: Episode) -> str:
        """The ``base_url`` of an episode's client."""
        return f"{self.url}/episodes/{episode.id}/v1"

    def close(self) -> None:
        self._server.close()
