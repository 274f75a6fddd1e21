"""`grpokit view --serve`: the report served live from 127.0.0.1 while a run writes to its folder. The page polls
``version`` (the sizes and times of the run's files) every 2 s and, when it changed, reloads ``data.json`` and
redraws; ``/`` is the page built from the folder as it is now. Read-only: GET and HEAD of these three paths,
anything else is answered 404 or 405; a request naming another host than 127.0.0.1 or localhost (DNS rebinding)
is answered 403."""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from grpokit.errors import ConfigError
from grpokit.viewer.report import MAX_COMPLETION_STEPS, render_html, report_data, version

HOST = "127.0.0.1"


def make_server(output_dir: Path, port: int, max_completion_steps: int = MAX_COMPLETION_STEPS) -> ThreadingHTTPServer:
    """A server for the run in ``output_dir`` on 127.0.0.1:``port`` (0: a free port; the bound one is
    ``server.server_address[1]``)."""
    output_dir = Path(output_dir)
    report_data(output_dir, max_completion_steps)  # a folder that is no run fails here, before the port is taken

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._answer(send_body=True)

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
            self._answer(send_body=False)

        def _refuse(self) -> None:
            self.send_error(405, "the viewer is read-only: GET or HEAD")

        do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815 - http.server's names

        def _answer(self, send_body: bool) -> None:
            host = (self.headers.get("Host") or "").rsplit(":", 1)[0]
            if host not in ("127.0.0.1", "localhost"):  # a page elsewhere whose name was rebound to this machine
                self.send_error(403, "the viewer answers requests for 127.0.0.1 or localhost only")
                return
            path = self.path.split("?", 1)[0]
            try:
                if path in ("/", "/report.html"):
                    body, kind = render_html(report_data(output_dir, max_completion_steps), live=True), "text/html"
                elif path == "/data.json":
                    data = report_data(output_dir, max_completion_steps)
                    body, kind = json.dumps(data, ensure_ascii=False, allow_nan=False), "application/json"
                elif path == "/version":
                    body, kind = version(output_dir), "text/plain"
                else:
                    self.send_error(404, "the viewer serves /, /data.json and /version")
                    return
            except ConfigError as e:  # the folder went away or was emptied while being served
                self.send_error(503, str(e))
                return
            data = body.encode("utf-8")
            self.send_response(200)
            self.send_header("Content-Type", f"{kind}; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if send_body:
                self.wfile.write(data)

        def log_message(self, format, *args) -> None:  # noqa: A002 - http.server's name
            pass  # one line per poll every 2 s would bury the run's own output

    try:
        return ThreadingHTTPServer((HOST, port), Handler)
    except OSError as e:
        raise ConfigError(
            f"grpokit view --serve: cannot listen on {HOST}:{port}: {e.strerror or e}; choose "
            "another --port (0 picks a free one)"
        ) from e


def serve(output_dir: Path, port: int, max_completion_steps: int = MAX_COMPLETION_STEPS) -> None:
    """Serve until interrupted; prints the address first."""
    server = make_server(output_dir, port, max_completion_steps)
    print(
        f"grpokit view: serving {Path(output_dir)} live at http://{HOST}:{server.server_address[1]}/ (Ctrl-C stops)",
        flush=True,
    )
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        sys.stdout.flush()
