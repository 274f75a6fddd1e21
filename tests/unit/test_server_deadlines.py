"""Waits with deadlines on a real uvicorn server (in a thread, 127.0.0.1): a client that disconnects frees the
engine at the next token, a rendezvous with a silent store answers within its capped timeout while
/close_communicator/ answers at once, and an unexpected error keeps the connection usable."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
import torch
from fastapi import FastAPI
from transformers import LogitsProcessorList

from grpokit.server.app import create_app
from grpokit.server.errors import ErrorMiddleware, install_error_handlers
from grpokit.server.state import ServerOptions, build_state
from grpokit.testing import serve_in_thread


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    state = build_state(ServerOptions(model=str(tiny_model_dir), torch_dtype="float32", max_sync_timeout_s=1.5))
    with serve_in_thread(create_app(state)) as (url, port):
        yield state, url, port


class _Probe:
    """A logits processor that forbids EOS (so that the completion runs to max_tokens) and reports progress."""

    def __init__(self, eos: int) -> None:
        self.eos, self.steps, self.decoding = eos, 0, threading.Event()

    def __call__(self, input_ids, scores):
        self.steps += 1
        if self.steps >= 3:
            self.decoding.set()
        return scores.index_fill(1, torch.tensor([self.eos], device=scores.device), float("-inf"))


def _raw_post(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


COUNT = [{"role": "user", "content": "count"}]
LONG_CALLS = {  # every generation route: a call that would sample 1,000 tokens
    "/infer/": {"requests": [{"messages": COUNT}], "request_config": {"max_tokens": 1000, "temperature": 1.0}},
    "/v1/chat/completions": {"model": "m", "messages": COUNT, "max_tokens": 1000, "temperature": 1.0},
}


@pytest.mark.parametrize("path", list(LONG_CALLS))
def test_a_disconnected_client_frees_the_engine_within_a_second(served, monkeypatch, path):
    state, url, port = served
    engine = state.engine
    probe = _Probe(engine.template.eos_token_id)
    monkeypatch.setattr(engine, "logits_processor_factory", lambda config, width: LogitsProcessorList([probe]))
    finished = threading.Event()
    original = engine.infer

    def infer(requests, config):
        try:
            return original(requests, config)
        finally:
            finished.set()

    monkeypatch.setattr(engine, "infer", infer)
    sock = _raw_post(port, path, LONG_CALLS[path])
    assert probe.decoding.wait(30), "generation did not start"
    assert state.inflight == 1  # counted against --max_inflight_requests while it runs
    sock.close()  # the client goes away mid-generation
    assert finished.wait(1.0), "the engine was still generating 1 s after the client disconnected"
    assert probe.steps < 900
    monkeypatch.setattr(engine, "infer", original)
    body = {"requests": [{"messages": [{"role": "user", "content": "hi"}]}], "request_config": {"max_tokens": 2}}
    short = httpx.post(url + "/infer/", timeout=10, json=body)
    assert short.status_code == 200 and len(short.json()) == 1
    assert state.inflight == 0 and not engine._cancel


@contextlib.contextmanager
def silent_store():
    """A TCP listener that accepts connections and never answers (what hung the rendezvous)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    conns, stop = [], threading.Event()

    def accept() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                conns.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for c in conns:  # the stuck c10d reads EOF and its thread ends
            c.close()
        listener.close()


def test_rendezvous_with_a_silent_store_answers_within_its_capped_timeout(served):
    state, url, _ = served
    answers: dict = {}
    with silent_store() as store_port:
        body = {
            "host": "127.0.0.1",
            "port": store_port,
            "rank": 1,
            "world_size": 2,
            "group": "g1",
            "timeout_s": 1000,
        }  # the server caps it at --max_sync_timeout_s 1.5

        def init() -> None:
            t0 = time.monotonic()
            answers["init"] = httpx.post(url + "/init_communicator/", json=body, timeout=30)
            answers["init_s"] = time.monotonic() - t0

        caller = threading.Thread(target=init)
        caller.start()
        deadline = time.monotonic() + 10
        while not state.receiver._pending:  # the rendezvous thread is waiting on the silent store
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        closed = httpx.post(url + "/close_communicator/", timeout=10)
        assert closed.json() == {"ok": True} and time.monotonic() - t0 < 1.0
        assert "init" not in answers  # still waiting: close did not queue behind the rendezvous
        caller.join(10)
        resp = answers["init"]
        assert resp.status_code == 424 and "did not finish within 1.5s" in resp.json()["error"]
        assert answers["init_s"] < 1.5 + 2.0
    assert httpx.get(url + "/health/", timeout=10).json() == {"status": "ok"}
    huge = httpx.post(url + "/init_communicator/", json={**body, "timeout_s": 1e9}, timeout=10)
    assert huge.status_code == 422 and "timeout_s" in huge.json()["error"]


def test_an_unexpected_error_is_json_and_the_connection_stays_usable():
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("secret detail")

    @app.get("/ok")
    async def ok():
        return {"ok": True}

    with serve_in_thread(ErrorMiddleware(app)) as (url, port), httpx.Client(base_url=url, timeout=10) as client:
        bad = client.get("/boom")
        assert bad.status_code == 500 and "RuntimeError" in bad.json()["error"]
        assert "secret detail" not in bad.text
        assert bad.headers.get("connection") != "close"
        assert client.get("/ok").json() == {"ok": True}  # the same keep-alive connection
        assert client.get("/nope").json() == {"error": "Not Found"}
        assert client.post("/ok").json() == {"error": "Method Not Allowed"}


def test_a_pause_that_loads_no_weights_leaves_a_seeded_rows_samples_as_they_were(served, monkeypatch):
    """A seeded row paused by /probe/ (the sync check's pause, which loads nothing) continues from the random
    state it paused at: its tokens are those of the same call left alone."""
    state, url, port = served
    engine = state.engine
    body = {
        "requests": [{"messages": [{"role": "user", "content": "count"}]}],
        "request_config": {"max_tokens": 120, "temperature": 1.0, "seed": 7},
    }

    def sampled(pause: bool) -> list[int]:
        probe = _Probe(engine.template.eos_token_id)
        monkeypatch.setattr(engine, "logits_processor_factory", lambda config, width: LogitsProcessorList([probe]))
        answer = {}
        call = threading.Thread(target=lambda: answer.update(r=httpx.post(url + "/infer/", json=body, timeout=120)))
        call.start()
        if pause:
            assert probe.decoding.wait(30), "generation did not start"
            assert httpx.post(url + "/probe/", json={"prompt": "hi", "max_tokens": 2}, timeout=60).status_code == 200
        call.join(120)
        return answer["r"].json()[0]["response"]["choices"][0]["token_ids"]

    alone = sampled(pause=False)
    resumes = engine.partial_resumes
    assert sampled(pause=True) == alone
    assert engine.partial_resumes == resumes + 1  # it was paused, and went on
