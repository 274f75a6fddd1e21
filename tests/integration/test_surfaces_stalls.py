"""The transport's deadlines on the two surfaces the rollout server's transport tests do not reach: the trainer's
``--agent`` endpoint and ``grpokit view --serve``, each served as it is in its process but with short deadlines.
A client that stalls in its headers, one that stalls in its body, one that drips its headers a byte at a time and
one that opens connections past the cap: each gets a 408 JSON error (or its connection closed) within its
deadline, and the surface then answers at once."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from agents_fakes import EchoEngine, tiny_template
from test_server_transport import _read_all

from grpokit.agents.episodes import EpisodeRecorder
from grpokit.agents.service import ChatService
from grpokit.protocol import RequestConfig
from grpokit.server.openai_routes import episode_app
from grpokit.server.options import TransportLimits
from grpokit.server.surface import BackgroundServer
from grpokit.server.viewer_site import ViewerSite, viewer_app

pytestmark = pytest.mark.slow
LIMITS = TransportLimits(header_timeout_s=1.0, body_timeout_s=2.0, body_idle_s=1.0, keep_alive_s=1.0, max_connections=8)
DEADLINE_S = 4.0  # every cut comes within this (the longest deadline plus scheduling)


@pytest.fixture(scope="module", params=["agent endpoint", "viewer"])
def surface(request, tiny_model_dir, tmp_path_factory):
    if request.param == "agent endpoint":
        recorder = EpisodeRecorder()
        service = ChatService(EchoEngine(tiny_template(tiny_model_dir)), "policy", RequestConfig(max_tokens=4))
        app, site = episode_app(service, recorder), None
        episode = recorder.open({"messages": [{"role": "user", "content": "hi"}]})
        path = f"/episodes/{episode.id}/v1/models"
    else:
        run = tmp_path_factory.mktemp("run")
        (run / "logging.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
        site = ViewerSite(run)
        app, path = viewer_app(site), "/version"
    server = BackgroundServer(app, LIMITS, name=f"stalled {request.param}")
    yield server, path
    server.close()
    if site is not None:
        site.close()


def _answers_at_once(server, path: str) -> None:
    t0 = time.monotonic()
    r = httpx.get(server.url + path, timeout=10)
    assert r.status_code in (200, 401) and time.monotonic() - t0 < 2.0  # (401: the episode's key is not sent)


@pytest.mark.parametrize(
    "sent",
    [
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n",  # headers never end
        b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{",
        b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'5\r\n{"a":',  # a chunked body that stops
    ],
    ids=["in headers", "in a body", "in a chunked body"],
)
def test_a_stalled_client_is_cut_at_its_deadline(surface, sent):
    server, path = surface
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(sent)
        data, took = _read_all(sock, DEADLINE_S + 2)
    assert took < DEADLINE_S and b"<still open>" not in data
    if data:  # a 408 in the one error shape (a body never started may be closed without an answer)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.split()[1] in (b"408", b"413"), head
        assert isinstance(json.loads(body)["error"], str | dict)
    _answers_at_once(server, path)


def test_headers_dripped_a_byte_at_a_time_are_cut_at_the_header_deadline(surface):
    server, path = surface
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        t0 = time.monotonic()
        try:
            for byte in b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
                if time.monotonic() - t0 > DEADLINE_S:
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        data, _ = _read_all(sock, DEADLINE_S + 2)
    assert time.monotonic() - t0 < 2 * DEADLINE_S and b"<still open>" not in data
    _answers_at_once(server, path)


def test_connections_past_the_cap_leave_the_surface_answering(surface):
    server, path = surface
    socks = [
        socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(3 * LIMITS.max_connections)
    ]
    try:
        _answers_at_once(server, path)
    finally:
        for s in socks:
            s.close()
