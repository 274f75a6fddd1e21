"""`grpokit view --serve`: the report served live from 127.0.0.1 while a run writes to its folder, on the hardened
transport every grpokit surface uses (server/surface.py: deadlines, connection cap, Host and cross-site checks).

The page polls ``/version`` (the sizes and times of the run's files) every 2 s and, when it changed, reloads
``/data.json`` and redraws; ``/`` is the page built from the folder as it is now. A version is built once, by one
worker thread, and its page and data are cached until the files change: however many requests come, at most one
rebuild runs, and a request waits for it at most ``build_timeout_s`` (503, retry). Idle connections hold no thread
(the event loop watches them, the transport closes them). Read-only: GET and HEAD of these paths; every other
answer is a JSON error ``{"error": one line}`` (404, 405; 503 while a folder cannot be read, 500 for a page that
could not be built), never a closed connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from grpokit.errors import ConfigError
from grpokit.server.guard import GuardPolicy
from grpokit.server.options import TransportLimits
from grpokit.server.surface import BackgroundServer, hardened
from grpokit.viewer.report import MAX_COMPLETION_STEPS, render_html, report_data, version

logger = logging.getLogger(__name__)
HOST = "127.0.0.1"
LIMITS = TransportLimits(max_connections=64)  # one person's browser tabs; more evict the idlest
PAGES = {"/": "html", "/report.html": "html", "/data.json": "json", "/version": "version"}
KINDS = {"html": b"text/html; charset=utf-8", "json": b"application/json", "version": b"text/plain; charset=utf-8"}


@dataclass(frozen=True)
class Built:
    stamp: str
    html: bytes
    json: bytes


class ViewerSite:
    """The viewer's ASGI application for the run in ``output_dir`` (module docstring)."""

    def __init__(self, output_dir: Path, max_completion_steps: int = MAX_COMPLETION_STEPS, build_timeout_s: float = 60):
        self.output_dir, self.max_completion_steps = Path(output_dir), max_completion_steps
        self.build_timeout_s = build_timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grpokit-view")  # one rebuild at a time
        self._built: Built | None = None
        self._building: Future | None = None

    def build(self) -> Built:
        """The page and data of the files as they are now (ConfigError: not a run's folder)."""
        data = report_data(self.output_dir, self.max_completion_steps)
        page = render_html(data, live=True).encode("utf-8")
        return Built(data["version"], page, json.dumps(data, ensure_ascii=False, allow_nan=False).encode("utf-8"))

    async def current(self) -> Built:
        """The page of the files as they are now: cached, or built by the one worker (a build already running is
        joined, not repeated); TimeoutError past ``build_timeout_s``."""
        stamp = version(self.output_dir)
        done = self._building is not None and self._building.done() and not self._building.cancelled()
        if done and self._building.exception() is None and self._building.result().stamp == stamp:
            self._built = self._building.result()  # built for this version while its callers were not yet back
        if self._built is not None and self._built.stamp == stamp:
            return self._built
        if self._building is None or self._building.done():
            self._building = self._pool.submit(self.build)
        built = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._building)), self.build_timeout_s)
        self._built = built
        return built

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        status, kind, body = await self._answer(scope)
        headers = [
            (b"content-type", KINDS.get(kind, b"application/json")),
            (b"content-length", str(len(body)).encode()),
            (b"cache-control", b"no-store"),
            (b"x-content-type-options", b"nosniff"),
        ]
        if status == 405:
            headers.append((b"allow", b"GET, HEAD"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    async def _answer(self, scope) -> tuple[int, str, bytes]:
        kind = PAGES.get(scope["path"])
        if scope["method"] not in ("GET", "HEAD"):
            return 405, "error", _error("the viewer is read-only: GET or HEAD")
        if kind is None:
            return 404, "error", _error(f"the viewer serves {', '.join(PAGES)}")
        try:
            if kind == "version":
                return 200, kind, (await asyncio.to_thread(version, self.output_dir)).encode()
            built = await self.current()
        except ConfigError as e:  # the folder went away or was emptied while being served
            return 503, "error", _error(str(e))
        except TimeoutError:
            return 503, "error", _error(f"the page is still being built after {self.build_timeout_s:g} s; retry")
        except Exception as e:  # noqa: BLE001 - a page that cannot be built is an answer, never a dropped connection
            logger.warning("grpokit view: building the page of %s failed", self.output_dir, exc_info=True)
            return 500, "error", _error(f"the page could not be built: {type(e).__name__}: {str(e)[:200]}")
        return 200, kind, built.html if kind == "html" else built.json

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def viewer_app(site: ViewerSite):
    """The site behind the guard every surface has: loopback Host names only, no cross-site requests, no body."""
    return hardened(site, GuardPolicy(api_key=None, max_body_bytes=0, host_hint=" (the viewer is local only)"))


def start(output_dir: Path, port: int, max_completion_steps: int = MAX_COMPLETION_STEPS) -> BackgroundServer:
    """The viewer served from a daemon thread of this process; ``close()`` stops it. A folder that is no run fails
    here (ConfigError), before the port is taken."""
    site = ViewerSite(output_dir, max_completion_steps)
    site.build()
    return BackgroundServer(viewer_app(site), LIMITS, host=HOST, port=port, name="grpokit view --serve")


def serve_viewer(output_dir: Path, port: int, max_completion_steps: int = MAX_COMPLETION_STEPS) -> None:
    """Serve until interrupted; prints the address first."""
    server = start(output_dir, port, max_completion_steps)
    print(f"grpokit view: serving {Path(output_dir)} live at {server.url}/ (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        sys.stdout.flush()
