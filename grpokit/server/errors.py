"""Every error the rollout server answers is JSON ``{"error": one line, ...}`` with a 4xx/5xx status.

``install_error_handlers`` covers what FastAPI raises itself (validation errors, the router's 404/405, body parsing)
and what the endpoints raise. ``ErrorMiddleware`` is the last net around the whole application: an exception that
escapes everything else still becomes a JSON 500, and it is not re-raised, so that the server keeps the connection
open for the client's next request (uvicorn drops a connection whose application raised).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


def error_body(message: str, **extra: Any) -> dict[str, Any]:
    """The JSON every error answer carries: a one-line ``error`` plus optional details."""
    return {"error": message, **extra}


def _shown(value: Any) -> str:
    """A short rendering of a refused value: scalars only (a body's text is never repeated back)."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, float)):
        text = json.dumps(value) if not isinstance(value, float) else f"{value:g}"
        return f" (got {text[:40]})"
    if isinstance(value, str) and len(value) <= 40:
        return f" (got {value!a})"
    return ""


def validation_message(errors: list[dict]) -> str:
    """One line out of pydantic's error list: the first problem, its location, the value, and how many more."""
    if not errors:
        return "invalid request body"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"body is not valid JSON ({first.get('ctx', {}).get('error', first.get('msg'))})"
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    shown = "" if first.get("type") == "value_error" else _shown(first.get("input"))
    return f"{loc}: {msg}{shown}{more}"


def _jsonable_errors(errors) -> list[dict]:
    return [
        {"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
        for e in errors[:20]
    ]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        return JSONResponse(
            status_code=422, content=error_body(validation_message(errors), detail=_jsonable_errors(errors))
        )

    @app.exception_handler(StarletteHTTPException)  # FastAPI's HTTPException, the router's 404/405, body parsing
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404 and _route_with_slash(app, request.url.path):  # no redirect: it would be built
            message += f": the endpoint is {request.url.path[:64]}/ (with the slash)"  # from the Host header
        return JSONResponse(
            status_code=exc.status_code, content=error_body(message), headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse(
            status_code=500,
            content=error_body(f"internal error ({type(exc).__name__}); the server's log has the details"),
        )


def _route_with_slash(app: FastAPI, path: str) -> bool:
    return not path.endswith("/") and any(getattr(r, "path", None) == path + "/" for r in app.routes)


class ErrorMiddleware:
    """Outermost ASGI layer: an exception from the application becomes a JSON 500 if no answer has started, and is
    never passed on to the server (which would drop the connection)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - the last net: answer, log, keep serving
            if started:  # Starlette's error handler already answered (and re-raised for the server's log)
                logger.debug(
                    "%s %s: error after the answer started", scope.get("method"), scope.get("path"), exc_info=exc
                )
                return
            logger.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=exc)
            body = json.dumps(error_body(f"internal error: {type(exc).__name__}")).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 500,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": body})
