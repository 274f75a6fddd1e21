"""ASGI middleware in front of every endpoint: the API key and the body size limit.

Both answer before the application sees the request, so a bad request costs no JSON parsing and cannot reach
the engine. Bodies are read here (up to the limit) and replayed to the application.
"""

from __future__ import annotations

import hmac
import json


async def _send_error(send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Refuses requests without ``Authorization: Bearer <api_key>`` (401) and bodies over ``max_body_bytes`` (413)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and not self._authorized(headers.get(b"authorization", b"")):
            await _send_error(send, 401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' "
                                         "(the key given to grpokit rollout --api_key or GRPOKIT_API_KEY)",
                              [(b"www-authenticate", b"Bearer")])
            return
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_body_bytes
            except ValueError:
                await _send_error(send, 400, f"bad Content-Length header {declared[:32]!r}")
                return
            if too_big:
                await _send_error(send, 413, self._too_big_message(int(declared)))
                return
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if scope.get("method") == "POST" and ctype and not (ctype == b"application/json" or ctype.endswith(b"+json")):
            await _send_error(send, 415, f"Content-Type {ctype.decode(errors='replace')!r}: send JSON with "
                                         "'Content-Type: application/json'")
            return
        chunks, size = [], 0
        while True:  # read the body here, bounded, also when it comes chunked without a length
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await _send_error(send, 413, self._too_big_message(size, at_least=True))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the client's disconnect, as usual

        await self.app(scope, replay, send)

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    def _too_big_message(self, size: int, at_least: bool = False) -> str:
        limit_mb = self.max_body_bytes / 1024 / 1024
        more = "more than " if at_least else ""
        return (f"request body of {more}{size} bytes exceeds the server's limit of {limit_mb:g} MB; send smaller "
                "batches or raise grpokit rollout --max_body_mb")
