"""Hostile requests to two HTTP surfaces at once, the rollout server (``/infer/`` and ``/v1``, the tiny model) and
the trainer's ``--agent`` endpoint (a fresh episode per case, a fake fast engine), both on the hardened transport in
a thread: bodies that are JSON only to a lax parser (a key twice, a 5,000-digit number, bytes that are no UTF-8),
pages of another port or site (Origin, Referer), headers sent twice, compressed or oversized chunked bodies,
model-written tool calls nested 100,000 deep, and a /v1 call of more choices than --max_inflight_requests. Each
gets one clear 4xx in its surface's error shape, never a 500; each surface answers a plain call afterwards."""

from __future__ import annotations

import json

import httpx
import pytest
from agents_fakes import EchoEngine, tiny_template

from grpokit.agents.episodes import EpisodeRecorder
from grpokit.agents.service import ChatService
from grpokit.protocol import RequestConfig
from grpokit.server.openai_routes import LocalEndpoint
from grpokit.server.options import TransportLimits
from grpokit.server.surface import BackgroundServer

pytestmark = pytest.mark.slow
KEY = "sweep-key"
HI = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def surfaces(tiny_model_dir):
    from grpokit.server.app import create_app
    from grpokit.server.state import ServerOptions, build_state

    options = ServerOptions(
        model=str(tiny_model_dir), torch_dtype="float32", api_key=KEY, max_body_mb=1, max_inflight_requests=3
    )
    rollout = BackgroundServer(create_app(build_state(options)), TransportLimits(), name="sweep rollout server")
    engine = EchoEngine(tiny_template(tiny_model_dir))
    recorder = EpisodeRecorder()
    service = ChatService(engine, "policy", RequestConfig(max_tokens=8), context=1024, max_prompt=512)  # as a run's
    endpoint = LocalEndpoint(service, recorder)
    with httpx.Client(timeout=60) as client:
        yield client, rollout, endpoint, recorder, engine
    endpoint.close()
    rollout.close()


def _target(surfaces, which: str) -> tuple[str, dict, str]:
    """(url, headers, body kind) of a call: the rollout server's /infer/ or /v1, or a fresh episode's."""
    _, rollout, endpoint, recorder, _ = surfaces
    if which == "episode":
        episode = recorder.open({"messages": HI})
        return endpoint.base_url(episode) + "/chat/completions", {"Authorization": f"Bearer {episode.key}"}, "v1"
    path = "/infer/" if which == "infer" else "/v1/chat/completions"
    return rollout.url + path, {"Authorization": f"Bearer {KEY}"}, which


def _body(kind: str) -> bytes:
    if kind == "infer":
        return json.dumps({"requests": [{"messages": HI}], "request_config": {"max_tokens": 2}}).encode()
    return json.dumps({"model": "m", "messages": HI, "max_tokens": 2}).encode()


def _error(r: httpx.Response) -> str:
    error = r.json()["error"]
    return error["message"] if isinstance(error, dict) else error  # OpenAI's shape on /v1 and the episodes


CASES = {  # name: (how the body or headers change, status, words of the answer)
    "key twice": (lambda b: b.replace(b"{", b'{"x": 1, "x": 2, ', 1), {}, 400, "key 'x' appears twice"),
    "5,000-digit number": (lambda b: b[:-1] + b', "seed": ' + b"9" * 5000 + b"}", {}, 400, "5000 characters"),
    "no UTF-8": (lambda b: b.replace(b'"hi"', b'"h\xffi"'), {}, 400, "not UTF-8"),
    "Origin on another port": (None, {"Origin": "http://127.0.0.1:1"}, 421, "web pages of other sites"),
    "Origin https default port": (None, {"Origin": "https://localhost"}, 421, "web pages of other sites"),
    "Referer of another site": (None, {"Referer": "https://evil.example/x"}, 403, "other sites"),
    "Referer on another port": (None, {"Referer": "http://127.0.0.1:9/x.html"}, 403, "other sites"),
    "br encoding": (None, {"Content-Encoding": "br"}, 415, "uncompressed"),
    "identity then gzip": (None, {"Content-Encoding": "identity, gzip"}, 415, "uncompressed"),
}


@pytest.mark.parametrize("which", ["infer", "v1", "episode"])
@pytest.mark.parametrize("case", list(CASES))
def test_hostile_bodies_and_headers_get_one_clear_4xx(surfaces, which, case):
    client = surfaces[0]
    url, headers, kind = _target(surfaces, which)
    change, extra, status, words = CASES[case]
    body = _body(kind) if change is None else change(_body(kind))
    r = client.post(url, content=body, headers={**headers, **JSON, **extra})
    assert r.status_code == status, r.text[:300]
    assert words in _error(r)
    url, headers, kind = _target(surfaces, which)  # the surface serves on (a fresh episode: its own key)
    assert client.post(url, content=_body(kind), headers={**headers, **JSON}).status_code == 200


@pytest.mark.parametrize("which", ["infer", "episode"])
def test_a_header_sent_twice_is_refused(surfaces, which):
    url, headers, kind = _target(surfaces, which)
    raw = [(k.encode(), v.encode()) for k, v in {**headers, **JSON}.items()]
    twice = [*raw, (b"authorization", b"Bearer other")]
    with httpx.Client(timeout=60) as client:
        r = client.post(url, content=_body(kind), headers=twice)
    assert r.status_code == 400 and "sent twice" in _error(r)


def test_a_chunked_body_past_the_limit_is_413(surfaces):
    client, rollout = surfaces[0], surfaces[1]
    sent = []

    def chunks():
        yield b'{"requests": [{"messages": [{"role": "user", "content": "'
        for _ in range(64):  # 4 MiB where 1 MiB is the limit
            sent.append(1)
            yield b"x" * (64 << 10)
        yield b'"}]}]}'

    r = client.post(rollout.url + "/infer/", content=chunks(), headers={"Authorization": f"Bearer {KEY}", **JSON})
    assert r.status_code == 413 and "limit" in _error(r)  # the rest was read and dropped: the answer arrives


@pytest.mark.parametrize(
    "reply",
    [
        "<tool_call>" + "[" * 100_000 + "]" * 100_000 + "</tool_call>",
        '<tool_call>{"name": "f", "arguments": {"x": ' + "1" * 6000 + "}}</tool_call>",
        '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"s": "\\ud800"}}</tool_call>',
    ],
    ids=["deep", "huge number", "key twice", "lone surrogate"],
)
def test_a_models_unparseable_tool_call_reaches_the_agent_as_text(surfaces, reply, monkeypatch):
    client, engine = surfaces[0], surfaces[4]
    monkeypatch.setattr(engine, "script", reply)
    url, headers, _ = _target(surfaces, "episode")
    r = client.post(url, json={"model": "m", "messages": HI, "max_tokens": 8}, headers=headers)
    assert r.status_code == 200, r.text[:300]
    message = r.json()["choices"][0]["message"]
    assert not message.get("tool_calls") and message["content"].startswith("<tool_call>")


def test_v1_counts_its_choices_against_the_inflight_limit(surfaces):
    client, rollout = surfaces[0], surfaces[1]
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "m", "messages": HI, "max_tokens": 2}
    r = client.post(rollout.url + "/v1/chat/completions", json={**body, "n": 4}, headers=headers)
    assert r.status_code == 429 and r.headers.get("retry-after") and "max_inflight_requests" in _error(r)
    r = client.post(rollout.url + "/v1/chat/completions", json={**body, "n": 3}, headers=headers)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


CALL = [
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
]
EPISODE_CASES = {  # messages past an episode's bounds, refused before any token is sampled
    "a tool_call_id of 300,000 characters": (
        HI + [{"role": "tool", "tool_call_id": "i" * 300_000, "content": "r"}],
        413,
    ),
    "an unrendered field in a tool call": (
        HI + [{**CALL[0], "tool_calls": [{**CALL[0]["tool_calls"][0], "zzz": "q" * 300_000}]}],
        413,
    ),
    "200,000 messages": ([{"role": "user", "content": "a"}] * 200_000, 422),
    "100,000 text parts": ([{"role": "user", "content": [{"type": "text", "text": "ab"}] * 100_000}], 400),
}


@pytest.mark.parametrize("case", list(EPISODE_CASES))
def test_an_episodes_call_past_its_bounds_samples_nothing(surfaces, case):
    client, engine = surfaces[0], surfaces[4]
    messages, status = EPISODE_CASES[case]
    url, headers, _ = _target(surfaces, "episode")
    calls = engine.calls
    r = client.post(url, json={"model": "m", "messages": messages}, headers=headers)
    assert r.status_code == status, r.text[:300]
    assert _error(r) and engine.calls == calls


def test_chained_calls_with_n_stop_at_the_trajectory_budget(surfaces):
    from grpokit.agents.episodes import episode_outputs  # not at the top: this test only

    client, endpoint, recorder = surfaces[0], surfaces[2], surfaces[3]
    episode = recorder.open({"messages": HI})
    url, headers = endpoint.base_url(episode) + "/chat/completions", {"Authorization": f"Bearer {episode.key}"}
    first = client.post(url, json={"model": "m", "messages": HI, "n": 4}, headers=headers).json()
    codes = []
    for choice in first["choices"]:  # each extends one reply, asking for 2 more: 4 + 2 + 2 = 8, then refused
        more = HI + [choice["message"], {"role": "user", "content": "more"}]
        codes.append(client.post(url, json={"model": "m", "messages": more, "n": 2}, headers=headers).status_code)
    assert codes == [200, 200, 400, 400]
    assert len(episode_outputs(episode)) == 8
