"""The guard's pieces: the JSON measure before parsing (against a reference walk of random JSON), the Host/Origin
policy, the guard's refusals as an ASGI app sees them, the log throttle and the connection cap."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from grpokit.errors import ConfigError
from grpokit.server import transport
from grpokit.server.guard import GuardMiddleware, GuardPolicy
from grpokit.server.hosts import HostPolicy, host_name
from grpokit.server.json_bounds import json_size


def _reference(value, depth: int = 0) -> tuple[int, int, int]:
    """(items, depth, longest string) as json_bounds defines them: a container counts its elements (at least 1)."""
    if isinstance(value, str):
        return 0, depth, len(value)
    if isinstance(value, dict):
        parts = [_reference(k, depth + 1) for k in value] + [_reference(v, depth + 1) for v in value.values()]
        own = max(len(value), 1)
    elif isinstance(value, list):
        parts, own = [_reference(v, depth + 1) for v in value], max(len(value), 1)
    else:
        return 0, depth, 0
    return (own + sum(p[0] for p in parts), max([depth + 1] + [p[1] for p in parts]), max([0] + [p[2] for p in parts]))


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 6 else 3)
    if kind == 0:
        return rng.choice([None, True, 1.5, -3])
    if kind in (1, 2):
        return "".join(rng.choice('ab,[]{}: "') for _ in range(rng.randrange(12)))  # quotes: escaped by dumps
    if kind in (3, 4):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": _random_json(rng, depth + 1) for i in range(rng.randrange(4))}


def test_the_measure_matches_a_walk_of_the_parsed_json():
    from grpokit.server import json_bounds

    rng = random.Random(0)
    for _ in range(300):
        value = {"v": _random_json(rng)}
        body = json.dumps(value).encode()
        items, depth, _ = _reference(value)
        got = json_size(body, 10**9, 10**9)
        assert (got.items, got.depth) == (items, depth), body
        if "\\" not in body.decode():  # lengths are counted without escapes
            assert json_bounds._longest(json_bounds._unescaped(body), 10**9) == _reference(value)[2], body


def test_the_longest_string_is_measured_across_slices(monkeypatch):
    from grpokit.server import json_bounds

    monkeypatch.setattr(json_bounds, "_SLICE", 64)
    body = json.dumps({"a": "x" * 1000, "b": ["y" * 10, "z" * 300]}).encode()
    assert json_bounds._longest(json_bounds._unescaped(body), 10**9) == 1000
    assert json_size(body, 10**9, 500).longest > 500  # past the limit: measured, and refused by the guard
    assert json_size(body, 10**9, 2000).longest <= 2000


def test_bodies_that_parse_into_too_much_are_caught_before_parsing():
    assert json_size(b"[" + b"{}," * 2_000_000 + b"{}]", 1_000_000, 1 << 30).items > 1_000_000
    assert json_size(b"[" * 100_000 + b"]" * 100_000, 1_000_000, 1 << 30).depth > 512
    text = json.dumps({"s": "[[[[" * 300 + ",,,," * 300_000}).encode()  # brackets and commas inside a string only
    measured = json_size(text, 1000, 1 << 30)
    assert measured.items == 1 and measured.depth == 1


@pytest.mark.parametrize(
    "header, allowed",
    [
        ("127.0.0.1:8000", True),
        ("localhost", True),
        ("LOCALHOST.:80", True),
        ("[::1]:8000", True),
        ("127.8.9.10", True),
        ("trainer-box", True),
        ("rebind.attacker.example:8000", False),
        ("10.0.0.5", False),
        ("", False),
        ("a@b", False),
        ("x:y", False),
        ("[::1", False),
        ("::1", False),
    ],
)
def test_host_policy_of_a_loopback_bind(header, allowed):
    policy = HostPolicy.for_bind("127.0.0.1", ["trainer-box"])
    assert policy.allows_host(header.encode()) is allowed


def test_host_policy_of_a_wildcard_bind_and_origins():
    policy = HostPolicy.for_bind("0.0.0.0")
    assert policy.allows_host(b"10.0.0.5:8000") and policy.allows_host(b"[fe80::1]:1")
    assert not policy.allows_host(b"rebind.attacker.example")
    assert not policy.allows_host(None)
    assert policy.allows_origin(b"http://127.0.0.1:3000") and policy.allows_origin(b"https://localhost")
    for origin in (b"null", b"http://evil.example", b"file://", b"http://user@127.0.0.1", b"ftp://127.0.0.1"):
        assert not policy.allows_origin(origin), origin
    assert HostPolicy.for_bind("127.0.0.1", ["*"]).allows_host(b"anything.example")
    assert host_name("Example.COM.:443") == "example.com"
    with pytest.raises(ConfigError, match="--allowed_hosts"):
        HostPolicy.for_bind("127.0.0.1", ["bad host/"])


def _call(guard: GuardMiddleware, headers: dict[str, str], body: bytes = b"", path: str = "/infer/"):
    """(status, JSON answer, response headers, whether the application ran) for one request through the guard."""
    seen = []

    async def app(scope, receive, send):
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard.app = app
    headers = {"Content-Length": str(len(body)), **headers}
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    start, payload = sent[0], sent[1]["body"]
    return start["status"], json.loads(payload), dict(start["headers"]), bool(seen)


def test_the_guard_refuses_before_the_application_sees_anything():
    guard = GuardMiddleware(
        None,
        GuardPolicy(
            api_key="k",
            max_body_bytes=1 << 20,
            max_json_items=100,
            max_json_string=1000,
            path_items={"/update_weights/": 5},
        ),
    )
    ok = {"Host": "127.0.0.1:8000", "Authorization": "Bearer k", "Content-Type": "application/json"}
    assert _call(guard, ok, b'{"a": 1}')[::3] == (200, True)
    status, answer, headers, ran = _call(guard, {**ok, "Host": "rebind.attacker.example"}, b"{}")
    assert (status, ran) == (421, False) and "rebind.attacker.example" in answer["error"]
    assert b"connection" not in headers  # its small body was read first: the connection ends clean or serves on
    status, _, headers, _ = _call(guard, {**ok, "Host": "rebind.attacker.example"}, b"x" * (65 << 10))
    assert status == 421 and headers.get(b"connection") == b"close"  # a big body is left unread: closed
    assert _call(guard, {**ok, "Origin": "http://evil.example"}, b"{}")[0] == 421
    status, answer, headers, ran = _call(guard, {**ok, "Content-Length": "2", "Transfer-Encoding": "chunked"}, b"{}")
    assert (status, ran) == (400, False) and "ambiguous framing" in answer["error"]
    assert headers.get(b"connection") == b"close"
    assert _call(guard, {**ok, "Authorization": "Bearer nope"}, b"{}")[0] == 401
    assert _call(guard, {**ok, "Content-Length": "99999999"}, b"{}")[0] == 413
    assert _call(guard, {**ok, "Content-Length": "-1"}, b"{}")[0] == 400
    status, answer, _, ran = _call(guard, ok, b"[" + b"1," * 200 + b"1]")
    assert (status, ran) == (413, False) and "more than 100 JSON items" in answer["error"]
    status, answer, _, _ = _call(guard, ok, b'{"buckets": [1, 2, 3, 4, 5, 6]}', path="/update_weights/")
    assert status == 413 and "limit of /update_weights/" in answer["error"]
    status, answer, _, _ = _call(guard, ok, json.dumps({"x": "a" * 2000}).encode())
    assert status == 413 and "JSON string of more than 1000" in answer["error"]
    status, answer, _, _ = _call(guard, ok, b"[" * 600 + b"]" * 600)
    assert status == 400 and "nested more than 512" in answer["error"]


def test_the_throttle_keeps_a_few_per_window_and_counts_the_rest(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(transport.time, "monotonic", lambda: now[0])
    throttle = transport.Throttle(window_s=60, per_window=3)
    assert [throttle.allow("accept")[0] for _ in range(10)] == [True] * 3 + [False] * 7
    assert throttle.allow("other") == (True, 0)
    now[0] = 61.0
    assert throttle.allow("accept") == (True, 7)  # the next one logged says how many were left out


def test_the_connection_cap_stays_below_the_descriptor_limit(monkeypatch):
    monkeypatch.setattr(transport.resource, "getrlimit", lambda which: (1024, 4096))
    monkeypatch.setattr(transport, "open_fds", lambda: 40)
    fit = 1024 - 40 - 2 * transport.BACKLOG - transport.FD_RESERVE
    assert transport.connection_cap(0) == fit
    assert transport.connection_cap(100) == 100
    assert transport.connection_cap(5000) == fit
    monkeypatch.setattr(transport.resource, "getrlimit", lambda which: (200, 200))
    with pytest.raises(ConfigError, match="ulimit -n"):
        transport.connection_cap(0)
