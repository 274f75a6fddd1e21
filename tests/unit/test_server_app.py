"""The rollout server's HTTP layer on a fake engine (no model): validation, limits, auth, weight-sync checks."""

from __future__ import annotations

import threading

import pytest
import torch
from fastapi.testclient import TestClient

from grpokit.engines.base import InferEngine
from grpokit.errors import RolloutError
from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice
from grpokit.rollout.scheduler import RolloutScheduler
from grpokit.server.app import create_app
from grpokit.server.state import ServerOptions, ServerState

KEY = "s3cret"


class EchoEngine(InferEngine):
    """Answers each request with its last message reversed."""

    engine_type = "echo"

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.device = torch.device("cpu")
        self.resets = 0

    def infer(self, requests, config):
        return [
            ChatCompletionResponse(
                choices=[
                    ChatCompletionResponseChoice(
                        message={"role": "assistant", "content": r.messages[-1]["content"][::-1]},
                        finish_reason="stop",
                        token_ids=[1, 2, 3],
                    )
                ]
            )
            for r in requests
        ]

    def check_weights(self, metas):
        return [f"{m.name}: no such parameter in the served model" for m in metas if m.name != "w"]

    def load_weights(self, named):
        raise AssertionError("no broadcast in these tests")

    def reset_prefix_cache(self):
        self.resets += 1


def make_client(**overrides) -> tuple[TestClient, ServerState]:
    options = ServerOptions(model="echo", **{"max_batch_requests": 4, "max_body_mb": 0.01, **overrides})
    engine = EchoEngine()
    state = ServerState(options, engine, RolloutScheduler(engine))
    return TestClient(create_app(state), base_url="http://127.0.0.1"), state


def _req(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], **extra}


def _healthy(client: TestClient, headers: dict | None = None) -> bool:
    return client.get("/health/", headers=headers or {}).json() == {"status": "ok"}


@pytest.fixture()
def client() -> TestClient:
    client, state = make_client()
    client.app_state = state
    return client


def test_infer_returns_outputs_in_request_order(client):
    body = {
        "requests": [_req("abc", request_id="r1"), _req("xyz", request_id="r2")],
        "request_config": {"max_tokens": 3, "temperature": 0},
    }
    out = client.post("/infer/", json=body).json()
    assert [o["messages"][-1]["content"] for o in out] == ["cba", "zyx"]
    assert [o["request_id"] for o in out] == ["r1", "r2"]
    assert out[0]["response_token_ids"] == [[1, 2, 3]] and out[0]["response_loss_mask"] == [[1, 1, 1]]


def test_engine_type_reports_the_server_setup(client):
    info = client.get("/get_engine_type/").json()
    assert info["engine_type"] == "echo" and info["enable_multi_turn"] is False and info["max_turns"] is None
    assert info["communicator"] is False and info["max_batch_requests"] == 4


@pytest.mark.parametrize(
    "payload, status, words",
    [
        (b'{"requests": [', 422, "not valid JSON"),
        (
            b'{"requests": [{"messages": [{"role": "user", "content": "x"}]}], '
            b'"request_config": {"max_tokens": "many"}}',
            422,
            "request_config.max_tokens",
        ),
        (
            b'{"requests": [{"messages": [{"role": "user", "content": "x"}], "colour": "red"}]}',
            422,
            "requests.0.colour",
        ),
        (b'{"requests": [], "extra": 1}', 422, "extra"),
        (b'{"requests": [{"messages": []}]}', 422, "at least one message"),
        (
            b'{"requests": [{"messages": [{"role": "user", "content": "x"}]}], "request_config": {"n": 2}}',
            400,
            "repeat the request",
        ),
        (
            b'{"requests": [{"messages": [{"role": "user", "content": "x"}], "request_config": {"n": 3}}]}',
            400,
            "requests[0].request_config.n 3",
        ),
        (
            b'{"requests": [{"messages": [{"role": "user", "content": "x"}], "request_config": {"n": 20000}}]}',
            422,
            "less than or equal to 1024 (got 20000)",
        ),
        (
            b'{"requests": [{"messages": [{"role": "user", "content": "x"}]}], "request_config": {"max_tokens": 1e15}}',
            422,
            "request_config.max_tokens",
        ),
        (
            b'{"requests": [{"messages": [{"role": "user", "content": "x"}]}], '
            b'"request_config": {"temperature": 1e-300}}',
            422,
            "must be 0 (greedy) or at least 0.01",
        ),
        (b'{"requests": [{"messages": [{"role": 7, "content": "x"}]}]}', 422, "role must be a string"),
        (b'{"requests": [{"messages": [{"role": "user", "content": "\\ud800"}]}]}', 422, "lone UTF-16 surrogate"),
        (
            b'{"requests": [{"messages": [{"role": "user", "content": "x"}]}], '
            b'"request_config": {"structured_outputs_json": "/etc/passwd"}}',
            422,
            "file paths are read only",
        ),
        (
            b'{"requests": [{"messages": [{"role": "user", "content": "x", "extra": '
            + b"[" * 500
            + b"]" * 500
            + b"}]}]}",
            422,
            "nested deeper than 32 levels",
        ),
    ],
)
def test_bad_bodies_get_a_4xx_with_a_message_and_the_server_keeps_serving(client, payload, status, words):
    resp = client.post("/infer/", content=payload, headers={"Content-Type": "application/json"})
    assert resp.status_code == status
    assert words in resp.json()["error"]
    assert _healthy(client)


def test_text_parts_are_joined_and_the_router_answers_json(client):
    body = {"requests": [_req([{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}])]}
    assert client.post("/infer/", json=body).json()[0]["messages"][-1]["content"] == "c\nba"
    assert client.get("/nope").json() == {"error": "Not Found"}
    assert client.put("/infer/").json() == {"error": "Method Not Allowed"}
    assert "/infer/" in client.get("/openapi.json").json()["paths"]


def test_non_json_content_type_is_refused(client):
    resp = client.post("/infer/", content=b"requests=1", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert resp.status_code == 415 and "application/json" in resp.json()["error"]
    assert _healthy(client)


def test_oversized_body_is_refused_declared_or_streamed(client):
    big = {"requests": [_req("x" * 20_000)]}  # > 0.01 MB = 10485 bytes
    resp = client.post("/infer/", json=big)
    assert resp.status_code == 413 and "--max_body_mb" in resp.json()["error"]

    def chunks():  # no Content-Length: counted while reading
        yield b'{"requests": [{"messages": [{"role": "user", "content": "'
        for _ in range(30):
            yield b"y" * 1000
        yield b'"}]}]}'

    resp = client.post("/infer/", content=chunks(), headers={"Content-Type": "application/json"})
    assert resp.status_code == 413
    assert _healthy(client)


def test_too_many_requests_per_call_and_in_flight():
    client, state = make_client()
    resp = client.post("/infer/", json={"requests": [_req(str(i)) for i in range(5)]})
    assert resp.status_code == 413 and "--max_batch_requests 4" in resp.json()["error"]
    state.inflight = 15  # max_inflight_requests defaults to 4 x 4 = 16: two more do not fit
    resp = client.post("/infer/", json={"requests": [_req("a"), _req("b")]})
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    resp = client.post("/v1/chat/completions", json={"model": "m", "messages": [_req("a")["messages"][0]], "n": 2})
    assert resp.status_code == 429 and "--max_inflight_requests" in resp.json()["error"]["message"]  # /v1 too
    state.inflight = 0
    assert client.post("/infer/", json={"requests": [_req("a"), _req("b")]}).status_code == 200


def test_api_key_is_required_on_every_endpoint():
    client, _ = make_client(api_key=KEY)
    assert client.get("/health/").status_code == 401
    assert client.get("/health/", headers={"Authorization": "Bearer wrong"}).status_code == 401
    resp = client.post("/infer/", json={"requests": [_req("a")]}, headers={"Authorization": f"Basic {KEY}"})
    assert resp.status_code == 401 and "Authorization: Bearer" in resp.json()["error"]
    ok = {"Authorization": f"Bearer {KEY}"}
    assert client.post("/infer/", json={"requests": [_req("a")]}, headers=ok).status_code == 200
    assert _healthy(client, ok)


def _weights_body(name: str, dry_run: bool) -> dict:
    meta = {"name": name, "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}
    return {"buckets": [{"nbytes": 8, "tensors": [meta]}], "dry_run": dry_run}


def test_update_weights_checks_names_and_needs_a_group(client):
    resp = client.post("/update_weights/", json=_weights_body("nope", dry_run=True))
    assert resp.status_code == 422 and "nope: no such parameter" in resp.json()["error"]
    assert client.post("/update_weights/", json=_weights_body("w", dry_run=True)).json() == {"ok": True, "group": None}
    resp = client.post("/update_weights/", json=_weights_body("w", dry_run=False))
    assert resp.status_code == 409 and "/init_communicator/" in resp.json()["error"]
    bad = {"host": "127.0.0.1", "port": 1, "rank": 2, "world_size": 2, "group": "g"}
    assert "below world_size 2" in client.post("/init_communicator/", json=bad).json()["error"]
    for field, value in (("host", "a\x00b"), ("host", "h/x"), ("timeout_s", 1e300), ("group", "a b")):
        assert field in client.post("/init_communicator/", json={**bad, "rank": 1, field: value}).json()["error"]
    nccl = {**bad, "rank": 1, "backend": "nccl"}
    assert "needs the served model on a GPU" in client.post("/init_communicator/", json=nccl).json()["error"]
    assert client.post("/close_communicator/").json() == {"ok": True}
    assert client.post("/reset_prefix_cache/").json() == {"ok": True}


def test_a_failed_update_stops_sampling_until_a_complete_one_and_no_version_is_an_unknown_tag(client, monkeypatch):
    state = client.app_state  # set by the fixture below
    monkeypatch.setattr(type(state.receiver), "is_open", property(lambda self: True))

    def half(body, load):
        raise RolloutError("the trainer's end went away after 1 of 2 buckets")

    monkeypatch.setattr(state.receiver, "receive", half)
    state.engine.set_policy_version(3)
    update = {**_weights_body("w", dry_run=False), "version": 4}
    assert client.post("/update_weights/", json=update).status_code == 424
    calls = {"/infer/": {"requests": [_req("a")]}, "/v1/chat/completions": {"model": "m", "messages": [_msg("a")]}}
    for path, body in calls.items():
        resp = client.post(path, json=body)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "5", path
    monkeypatch.setattr(state.receiver, "receive", lambda body, load: 1)
    assert client.post("/update_weights/", json=_weights_body("w", dry_run=False)).status_code == 200
    assert state.engine.policy_version is None  # an update without a version: unknown, never the old tag
    assert client.post("/infer/", json=calls["/infer/"]).status_code == 200


def _msg(text: str) -> dict:
    return _req(text)["messages"][0]


def _meta(name="w", **kw) -> dict:
    return {"name": name, "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8, **kw}


@pytest.mark.parametrize(
    "buckets, words",
    [
        ([{"nbytes": 8, "tensors": [_meta(nbytes=12)]}], "is 8 bytes, not nbytes 12"),
        ([{"nbytes": 1 << 40, "tensors": [_meta()]}], "tensors end at byte 8"),
        ([{"nbytes": 10, "tensors": [_meta(offset=2)]}], "not a multiple of 4"),
        ([{"nbytes": 12, "tensors": [_meta(), _meta("v", offset=4)]}], "overlap"),
        ([{"nbytes": 8, "tensors": [_meta()]}, {"nbytes": 8, "tensors": [_meta()]}], "w: sent twice"),
        ([{"nbytes": 8, "tensors": [_meta(dtype="complex64")]}], "dtype"),
        ([{"nbytes": 0, "tensors": []}], "at least 1 item"),
    ],
)
def test_weight_metadata_is_checked_whole_before_any_broadcast(client, buckets, words):
    resp = client.post("/update_weights/", json={"buckets": buckets})
    assert resp.status_code == 422 and words in resp.json()["error"]


def test_buckets_of_several_tensors_are_capped():
    client, _ = make_client(max_weight_bucket_mb=1e-5)  # ~10 bytes
    two = {"nbytes": 24, "tensors": [_meta(), _meta("w2", offset=16)]}
    resp = client.post("/update_weights/", json={"buckets": [two], "dry_run": True})
    assert resp.status_code == 422 and "exceeds --max_weight_bucket_mb" in resp.json()["error"]
    alone = {"nbytes": 8, "tensors": [_meta()]}  # one tensor may exceed the cap (its shape bounds it)
    assert client.post("/update_weights/", json={"buckets": [alone], "dry_run": True}).status_code == 200


def test_a_batch_is_split_so_that_its_prefill_fits_the_budget():
    from types import SimpleNamespace

    from grpokit.engines.transformers_engine import TransformersEngine

    engine = SimpleNamespace(
        max_batch_size=4, max_prefill_bytes=None, model=SimpleNamespace(config=SimpleNamespace(num_attention_heads=1))
    )
    flat = [[1] * 10] * 3 + [[2] * 10, [3] * 10, [4] * 20]

    def chunks() -> list[tuple[int, int]]:
        return [(c.start, min(c.stop, len(flat))) for c in TransformersEngine._chunks(engine, flat)]

    assert chunks() == [(0, 4), (4, 6)]  # max_batch_size only
    engine.max_prefill_bytes = 2 * 10 * 10 * 5  # two distinct 10-token prompts (5 bytes a cell with one head)
    assert chunks() == [(0, 4), (4, 5), (5, 6)]  # copies of a prompt count once; a row alone always runs
