"""ASGI middleware in front of every endpoint: Host/Origin, framing, the API key, and the body's size and shape.

Everything here answers before the application sees the request, so a bad request costs no JSON parsing and cannot
reach the engine. Every HTTP surface has it (server/surface.py). In order: a header sent twice that must be sent
once 400; a ``Host`` (or ``Origin``) the server is not reached by, or an ``Origin`` on another port, gets 421
(server/hosts.py); a ``Referer`` of such a page 403; a browser's ``Sec-Fetch-Site: cross-site`` or ``same-site`` (a
page of another site, which sends no ``Origin`` with a GET) 403; a compressed body (``Content-Encoding``) 415;
``Content-Length`` together with ``Transfer-Encoding`` (ambiguous framing) gets 400 and the connection is closed;
a missing or wrong API key 401; a body over ``max_body_bytes`` 413; a body whose JSON would parse into more items
than its endpoint's budget, hold a longer string than ``max_json_string``, or nest deeper than ``MAX_BODY_DEPTH``,
413/400 (server/json_bounds.py). Bodies are read
here (up to the limit) and replayed to the application. A refused body is read and dropped before the answer when
that is cheap (up to 64 KiB when refused from its headers, up to 16 MiB past the size limit, within 5 s), since a
socket closed with bytes unread is reset and the reset can beat the answer to the client; beyond that the
connection is closed with the rest unread.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass, field

from grpokit.server.hosts import HostPolicy
from grpokit.server.json_bounds import MAX_BODY_DEPTH, json_size

CLOSE = (b"connection", b"close")
MISDIRECTED = 421
ONCE = (  # refused twice
    b"host",
    b"content-length",
    b"transfer-encoding",
    b"origin",
    b"referer",
    b"sec-fetch-site",
    b"authorization",
    b"content-encoding",
)
# a body refused from its headers is read before the answer when this small, and one past the size limit up to
# LINGER_BYTES more, each within DRAIN_S: the connection then ends clean; beyond those it is closed unread
DRAIN_BYTES, LINGER_BYTES, DRAIN_S = 64 << 10, 16 << 20, 5.0
SCAN_OFF_LOOP_BYTES = 1 << 20  # bodies larger than this are measured in a thread, off the event loop


async def _send_error(send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"error": message}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _has_body(scope) -> bool:
    for name, value in scope.get("headers") or []:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
            return True
    return False


async def _drained(scope, receive) -> bool:
    """Read and drop a refused request's body when it is small and plainly framed (one Content-Length, at most
    DRAIN_BYTES, no Transfer-Encoding); whether all of it was read."""
    lengths = [v for n, v in scope.get("headers") or [] if n == b"content-length"]
    chunked = any(n == b"transfer-encoding" for n, _ in scope.get("headers") or [])
    if chunked or len(lengths) != 1 or not lengths[0].strip().isdigit() or int(lengths[0]) > DRAIN_BYTES:
        return False
    return await _discard(receive, DRAIN_BYTES)


async def _discard(receive, budget: int) -> bool:
    """Read and drop what is left of a request's body, at most ``budget`` bytes within DRAIN_S; whether it ended.
    A socket closed with unread bytes is reset, and the reset can reach the client before the answer does."""

    async def read_rest() -> bool:
        left = budget
        while left >= 0:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            if not message.get("more_body", False):
                return True
            left -= len(message.get("body", b""))
        return False

    try:
        return await asyncio.wait_for(read_rest(), DRAIN_S)
    except TimeoutError:
        return False


@dataclass(frozen=True)
class GuardPolicy:
    """What the guard checks: ``api_key`` (None: no key), ``max_body_bytes``, the ``hosts`` a request may name,
    and the JSON items a body may hold (``path_items`` per path, ``max_json_items`` elsewhere)."""

    api_key: str | None
    max_body_bytes: int
    hosts: HostPolicy = field(default_factory=lambda: HostPolicy.for_bind("127.0.0.1"))
    max_json_items: int = 1_000_000
    max_json_string: int = 24 << 20  # characters of one JSON string (a base64 image at --max_image_mb fits)
    path_items: dict[str, int] = field(default_factory=dict)
    item_hints: dict[str, str] = field(default_factory=dict)  # per path: why its budget is what it is
    host_hint: str = ", or start grpokit rollout with --allowed_hosts NAME"  # how to allow another Host ("": none)


def _cross_site(headers: dict[bytes, bytes], hosts: HostPolicy) -> tuple[int, str, list] | None:
    """A refusal of a request a web page of another site (or of another port of this machine) sent: its ``Origin``
    (421), its ``Referer`` (403), or, for a plain GET that carries neither, the browser's ``Sec-Fetch-Site`` (403)."""
    origin = headers.get(b"origin")
    host = headers.get(b"host")
    if origin is not None and not (hosts.allows_origin(origin) and hosts.same_port(origin, host)):
        return (
            MISDIRECTED,
            f"Origin {origin[:64].decode('latin-1')!r} is not allowed: the server takes no requests from web "
            "pages of other sites",
            [CLOSE],
        )
    referer = headers.get(b"referer")
    if referer is not None and not (hosts.allows_origin(referer) and hosts.same_port(referer, host)):
        return 403, f"Referer {referer[:64].decode('latin-1')!r}: no requests from web pages of other sites", [CLOSE]
    site = headers.get(b"sec-fetch-site", b"").strip().lower()
    if site in (b"cross-site", b"same-site"):
        return 403, f"Sec-Fetch-Site {site.decode('latin-1')}: no requests from web pages of other sites", [CLOSE]
    return None


class GuardMiddleware:
    """Applies a ``GuardPolicy`` to every HTTP request (module docstring)."""

    def __init__(self, app, policy: GuardPolicy) -> None:
        self.app = app
        self.policy = policy
        self.api_key = policy.api_key.encode() if policy.api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refuse_headers(scope)
        if refusal is not None:
            status, message, headers = refusal
            # a small body is read first: closing a socket with unread bytes resets it, and the reset can reach
            # the client before the answer does
            unread = _has_body(scope) and not await _drained(scope, receive)
            if CLOSE in headers and status != 400 and not unread:
                headers = [h for h in headers if h != CLOSE]  # nothing unread: the connection can serve on
            await _send_error(send, status, message, headers)
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the client's disconnect, as usual

        await self.app(scope, replay, send)

    def _refuse_headers(self, scope) -> tuple[int, str, list] | None:
        """(status, message, headers) of a refusal decided from the request line and headers, or None."""
        headers: dict[bytes, bytes] = {}
        for name, value in scope.get("headers") or []:
            if name in headers and name in ONCE:
                return 400, f"the {name.decode()} header is sent twice; send it once", [CLOSE]
            headers[name] = value
        hosts = self.policy.hosts
        if not hosts.allows_host(headers.get(b"host")):
            shown = headers.get(b"host", b"(none)")[:64].decode("latin-1")
            return (
                MISDIRECTED,
                (
                    f"Host {shown!r} is not a name this server is reached by ({hosts.describe()}); "
                    f"connect by one of those{self.policy.host_hint}"
                ),
                [CLOSE],
            )
        cross = _cross_site(headers, hosts)
        if cross is not None:
            return cross
        coding = headers.get(b"content-encoding", b"identity").strip().lower()
        if coding not in (b"", b"identity"):  # a compressed body would decode past every size budget
            return 415, f"Content-Encoding {coding[:32].decode('latin-1')!r}: send the body uncompressed", [CLOSE]
        if b"transfer-encoding" in headers and b"content-length" in headers:
            return 400, "ambiguous framing: both Content-Length and Transfer-Encoding are sent; send one", [CLOSE]
        if self.api_key is not None and not self._authorized(headers.get(b"authorization", b"")):
            return (
                401,
                (
                    "missing or wrong API key: send the header 'Authorization: Bearer KEY' (the key given to "
                    "grpokit rollout --api_key or GRPOKIT_API_KEY)"
                ),
                [(b"www-authenticate", b"Bearer"), CLOSE],
            )
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or len(declared) > 18:
                return 400, f"bad Content-Length header {declared[:32]!r}", [CLOSE]
            if int(declared) > self.policy.max_body_bytes:
                return 413, self._too_big_message(int(declared)), [CLOSE]
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if scope.get("method") == "POST" and ctype and not (ctype == b"application/json" or ctype.endswith(b"+json")):
            return (
                415,
                (
                    f"Content-Type {ctype.decode(errors='replace')[:64]!r}: send JSON with "
                    "'Content-Type: application/json'"
                ),
                [CLOSE],
            )
        return None

    async def _read_body(self, scope, receive, send) -> bytes | None:
        """The whole body, bounded in bytes and JSON items; None when refused (answered) or the client left."""
        chunks, size = [], 0
        while True:  # read the body here, bounded, also when it comes chunked without a length
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.policy.max_body_bytes:
                if message.get("more_body", False):  # the rest is read and dropped, within bounds, so that the
                    await _discard(receive, LINGER_BYTES)  # client gets the answer; past them it is closed on
                await _send_error(send, 413, self._too_big_message(size, at_least=True), [CLOSE])
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if not body:
            return body
        path = scope.get("path", "")
        budget = self.policy.path_items.get(path, self.policy.max_json_items)
        longest = self.policy.max_json_string
        measured = (
            await asyncio.to_thread(json_size, body, budget, longest)
            if len(body) > SCAN_OFF_LOOP_BYTES
            else json_size(body, budget, longest)
        )
        if measured.depth > MAX_BODY_DEPTH:
            await _send_error(
                send, 400, f"refused before parsing the body: JSON nested more than {MAX_BODY_DEPTH} levels deep"
            )
            return None
        if measured.items > budget:
            hint = self.policy.item_hints.get(
                path, "split the batch into smaller calls, or raise grpokit rollout --max_json_items"
            )
            await _send_error(
                send,
                413,
                f"the body holds more than {budget} JSON items (array elements and object "
                f"members), the limit of {path}; {hint}",
            )
            return None
        if measured.longest > longest:
            await _send_error(
                send,
                413,
                f"the body holds a JSON string of more than {longest} characters, longer "
                "than any prompt or base64 image this server takes; send less (images: "
                "at most grpokit rollout --max_image_mb each)",
            )
            return None
        return body

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    def _too_big_message(self, size: int, at_least: bool = False) -> str:
        limit_mb = self.policy.max_body_bytes / 1024 / 1024
        more = "more than " if at_least else ""
        return (
            f"request body of {more}{size} bytes exceeds the server's limit of {limit_mb:g} MB; send smaller "
            "batches or raise grpokit rollout --max_body_mb"
        )
