"""The hand-written hostile set: bad and hostile requests of the kinds the server once mishandled, sent to a real
`grpokit rollout` (tiny model, API key, 127.0.0.1) running under `prlimit --as=4G`. Every one gets its 4xx (or its
200 where the input is fine), the error bodies are JSON, /health/ answers within a second after each, nothing fails
to allocate, the peak RSS stays below twice the idle figure and the descriptors go back to idle. ``CASES`` are the
earlier rounds' (one keep-alive connection for all: it must survive each answer); ``ROUND3`` the third round's
(small bodies that parsed or decoded into gigabytes, schemas and regexes past the grammar engine's limits, foreign
Host and Origin), each on a fresh connection since some refusals close theirs."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time

import httpx
import pytest
from test_server_support import fds_settle, health_s, limited_server, memory_kb, open_fds

from grpokit.testing import build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit")]

KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SYNC_CAP_S = 2.0


def _msg(text, role="user") -> dict:
    return {"messages": [{"role": role, "content": text}]}


def _infer(config: dict | None = None, **request) -> dict:
    return {"requests": [{**_msg("hi"), **request}], "request_config": {"max_tokens": 4, **(config or {})}}


def _weights(*tensors: dict, nbytes: int | None = None, dry_run: bool = True) -> dict:
    end = max(t["offset"] + t["nbytes"] for t in tensors)
    return {"buckets": [{"nbytes": end if nbytes is None else nbytes, "tensors": list(tensors)}], "dry_run": dry_run}


LM = {"name": "lm_head.weight", "dtype": "float32", "shape": [512, 64], "offset": 0, "nbytes": 512 * 64 * 4}
INIT = {"host": "127.0.0.1", "port": 9, "rank": 1, "world_size": 2, "group": "g"}

# (class, name, path, json body or raw bytes, expected status, words in the error)
CASES = [
    (1, "max_tokens 1e8", "/infer/", _infer({"max_tokens": 10**8}), 422, "max_tokens"),
    (1, "max_tokens 1e15", "/infer/", _infer({"max_tokens": 10**15}), 422, "max_tokens"),
    (1, "60k-token prompt", "/infer/", {"requests": [_msg("hello " * 60000)]}, 400, "maximum context length is"),
    (1, "prompt + max_tokens over the context", "/infer/", _infer({"max_tokens": 1020}), 400, "max_tokens 1020"),
    (
        1,
        "64 distinct 960-token prompts in one call",
        "/infer/",
        {
            "requests": [_msg(f"{i} " + "what is the answer " * 235) for i in range(64)],
            "request_config": {"max_tokens": 1},
        },
        200,
        "",
    ),
    (1, "n 20000", "/infer/", _infer({"n": 20000}), 422, "request_config.n"),
    (1, "1000 stop strings", "/infer/", _infer({"stop": ["x"] * 1000}), 422, "request_config.stop"),
    (1, "100k-character regex", "/infer/", _infer({"structured_outputs_regex": "a" * 100_000}), 422, "regex"),
    (
        1,
        "5000 messages",
        "/infer/",
        {"requests": [{"messages": [{"role": "user", "content": "x"}] * 5000}]},
        422,
        "5000 messages",
    ),
    (
        1,
        "1 TiB bucket",
        "/update_weights/",
        _weights({**LM, "shape": [1 << 40], "dtype": "uint8", "nbytes": 1 << 40}),
        422,
        "shape",
    ),
    (1, "bucket larger than its tensors", "/update_weights/", _weights(LM, nbytes=1 << 40), 422, "tensors end"),
    (
        1,
        "tensor bigger than 1 TiB",
        "/update_weights/",
        _weights({**LM, "shape": [1 << 41], "nbytes": 1 << 43}),
        422,
        "nbytes",
    ),
    (2, "per-request n 20000", "/infer/", _infer(request_config={"n": 20000}), 422, "requests.0.request_config.n"),
    (2, "per-request n 2", "/infer/", _infer(request_config={"n": 2}), 400, "requests[0].request_config.n 2"),
    (2, "per-request max_tokens 1e8", "/infer/", _infer(request_config={"max_tokens": 10**8}), 422, "max_tokens"),
    (
        2,
        "per-request subnormal temperature",
        "/infer/",
        _infer(request_config={"temperature": 5e-324}),
        422,
        "temperature",
    ),
    (3, "subnormal temperature", "/infer/", _infer({"temperature": 5e-324}), 422, "at least 0.01"),
    (3, "subnormal repetition penalty", "/infer/", _infer({"repetition_penalty": 5e-324}), 422, "repetition_penalty"),
    (
        3,
        "NaN temperature",
        "/infer/",
        b'{"requests": [{"messages": [{"role": "user", "content": "x"}]}], "request_config": {"temperature": NaN}}',
        422,
        "temperature",
    ),
    (
        3,
        "infinite top_p",
        "/infer/",
        b'{"requests": [{"messages": [{"role": "user", "content": "x"}]}], "request_config": {"top_p": Infinity}}',
        422,
        "top_p",
    ),
    (3, "top_k -5", "/infer/", _infer({"top_k": -5}), 422, "top_k"),
    (3, "seed 2**70", "/infer/", _infer({"seed": 2**70}), 422, "seed"),
    (3, "empty stop string", "/infer/", _infer({"stop": [""]}), 422, "stop"),
    (3, "content null", "/infer/", {"requests": [_msg(None)]}, 422, "content must be a string"),
    (3, "role not a string", "/infer/", {"requests": [_msg("x", role=5)]}, 422, "role must be a string"),
    (
        3,
        "content as text parts",
        "/infer/",
        {"requests": [_msg([{"type": "text", "text": "a"}])], "request_config": {"max_tokens": 2}},
        200,
        "",
    ),
    (
        3,
        "content with an image part",
        "/infer/",
        {"requests": [_msg([{"type": "image_url", "image_url": "x"}])]},
        422,
        "only text parts",
    ),
    (
        3,
        "lone surrogate",
        "/infer/",
        b'{"requests": [{"messages": [{"role": "user", "content": "a\\ud800"}]}]}',
        422,
        "lone UTF-16 surrogate",
    ),
    (
        3,
        "surrogate in a stop string",
        "/infer/",
        b'{"requests": [{"messages": [{"role": "user", "content": "a"}]}], "request_config": {"stop": ["\\udfff"]}}',
        422,
        "surrogate",
    ),
    (
        3,
        "regex with no match in the vocabulary",
        "/infer/",
        _infer({"structured_outputs_regex": r"[^\x00-\x{10FFFF}]"}),
        400,
        "allows no continuation",
    ),
    (3, "regex with no closing", "/infer/", _infer({"structured_outputs_regex": "[0-9"}), 400, "unclosed"),
    (3, "weights: shape and nbytes disagree", "/update_weights/", _weights({**LM, "nbytes": 8}), 422, "not nbytes 8"),
    (
        3,
        "weights: misaligned offset",
        "/update_weights/",
        _weights({**LM, "offset": 2}, nbytes=2 + LM["nbytes"]),
        422,
        "not a multiple of 4",
    ),
    (
        3,
        "weights: overlapping tensors",
        "/update_weights/",
        _weights(LM, {**LM, "name": "model.norm.weight", "shape": [64], "nbytes": 256, "offset": 16}),
        422,
        "overlap",
    ),
    (3, "weights: a name twice", "/update_weights/", {"buckets": [_weights(LM)["buckets"][0]] * 2}, 422, "sent twice"),
    (3, "weights: unknown dtype", "/update_weights/", _weights({**LM, "dtype": "complex128"}), 422, "dtype"),
    (3, "NUL in the host", "/init_communicator/", {**INIT, "host": "127.0.0.1\u0000x"}, 422, "host"),
    (3, "timeout_s 1e300", "/init_communicator/", {**INIT, "timeout_s": 1e300}, 422, "timeout_s"),
    (3, "rank outside the world", "/init_communicator/", {**INIT, "rank": 5}, 422, "below world_size"),
    (
        3,
        "message field nested 500 deep",
        "/infer/",
        b'{"requests": [{"messages": [{"role": "user", "content": "x", "x": ' + b"[" * 500 + b"]" * 500 + b"}]}]}",
        422,
        "nested",
    ),
    (4, "unknown path", "/nope/", {}, 404, "Not Found"),
    (4, "JSON nested 100k deep", "/infer/", b"[" * 100_000 + b"]" * 100_000, 400, "parsing the body"),
    (4, "truncated JSON", "/infer/", b'{"requests": [', 422, "not valid JSON"),
    (4, "unknown field", "/infer/", {**_infer(), "priority": 1}, 422, "priority"),
    (
        5,
        "schema path to a system file",
        "/infer/",
        _infer({"structured_outputs_json": "/etc/passwd"}),
        422,
        "file paths are read only",
    ),
    (
        5,
        "schema path that does not exist",
        "/infer/",
        _infer({"structured_outputs_json": "/nope/s.json"}),
        422,
        "file paths are read only",
    ),
    (
        5,
        "schema path, relative",
        "/infer/",
        _infer({"structured_outputs_json": "schema.json"}),
        422,
        "file paths are read only",
    ),
    (
        5,
        "schema that llguidance refuses",
        "/infer/",
        _infer({"structured_outputs_json": {"type": "objectx", "secret": "s3cr3t"}}),
        400,
        "structured_outputs_json schema",
    ),
    (6, "rendezvous timeout 1e9", "/init_communicator/", {**INIT, "timeout_s": 1e9}, 422, "timeout_s"),
]


def _pngs_4096(count: int) -> list[str]:
    """``count`` distinct 4096 x 4096 PNGs, a few KB each: 16M pixels apiece once decoded."""
    import base64
    import io

    from PIL import Image

    out = []
    for i in range(count):
        buf = io.BytesIO()
        Image.new("L", (4096, 4096), color=i).save(buf, "PNG")
        out.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return out


def _many_buckets(n: int) -> bytes:
    bucket = '{"nbytes": 4, "tensors": [{"name": "w%d", "dtype": "float32", "shape": [1], "offset": 0, "nbytes": 4}]}'
    return ('{"buckets": [' + ", ".join(bucket % i for i in range(n)) + '], "dry_run": true}').encode()


def _empty_messages(mib: int) -> bytes:
    return b'{"requests": [{"messages": [' + b"{}," * (mib * 2**20 // 3) + b"{}]}]}"


def _unused_field(mib: int) -> bytes:
    return (
        b'{"requests": [{"messages": [{"role": "user", "content": "hi", "note": "'
        + b"a" * (mib * 2**20)
        + b'"}]}], "request_config": {"max_tokens": 2}}'
    )


REBIND = {"Host": "rebind.attacker.example:8000"}
IDLE: dict[str, int] = {}
# third round: (name, method, path, body (JSON, bytes, or a callable making bytes), headers, status, words)
ROUND3 = [
    (
        "schema as text nested 3000 deep",
        "POST",
        "/infer/",
        _infer({"structured_outputs_json": '{"a": ' * 3000 + "1" + "}" * 3000}),
        {},
        400,
        "nests deeper than",
    ),
    (
        "regex past the grammar limits",
        "POST",
        "/infer/",
        _infer({"structured_outputs_regex": "x{1000}{1000}"}),
        {},
        400,
        "x{1000}{1000}",
    ),
    (
        "nested repetition past the grammar limits",
        "POST",
        "/infer/",
        _infer({"structured_outputs_regex": "((a{100}){100}){100}"}),
        {},
        400,
        "cannot follow it",
    ),
    (
        "per-request regex past the grammar limits",
        "POST",
        "/infer/",
        _infer(request_config={"structured_outputs_regex": "(y{1000}){1000}", "max_tokens": 4}),
        {},
        400,
        "grammar engine",
    ),
    (
        "24 distinct 4096x4096 PNGs to a text-only server",
        "POST",
        "/infer/",
        lambda: json.dumps({"requests": [{**_msg("x"), "images": [p]} for p in _pngs_4096(24)]}).encode(),
        {},
        400,
        "text-only",
    ),
    (
        "update_weights dry run with 500k buckets",
        "POST",
        "/update_weights/",
        lambda: _many_buckets(500_000),
        {},
        413,
        "tensors",
    ),
    ("53 MiB of empty messages", "POST", "/infer/", lambda: _empty_messages(53), {}, 413, "JSON items"),
    (
        "2M numbers in data_dict",
        "POST",
        "/infer/",
        lambda: (
            b'{"requests": [{"messages": [{"role": "user", "content": "x"}], "data_dict": {"n": ['
            + b"0," * 2_000_000
            + b"0]}}]}"
        ),
        {},
        413,
        "JSON items",
    ),
    (
        "one unused 60 MiB message field",
        "POST",
        "/infer/",
        lambda: _unused_field(60),
        {},
        413,
        "JSON string of more than",
    ),
    (
        "one unused 20 MiB message field",
        "POST",
        "/infer/",
        lambda: _unused_field(20),
        {},
        413,
        "beside role and content",
    ),
    (
        "1000 messages with a 40 KB unused field each",
        "POST",
        "/infer/",
        lambda: json.dumps(
            {
                "requests": [{"messages": [{"role": "user", "content": "x", "note": "n" * 40_000}] * 1000}],
                "request_config": {"max_tokens": 2},
            }
        ).encode(),
        {},
        413,
        "call's message fields",
    ),
    ("body nested 600 deep", "POST", "/infer/", b"[" * 600 + b"]" * 600, {}, 400, "nested more than"),
    ("rebinding Host on /infer/", "POST", "/infer/", _infer(), REBIND, 421, "rebind.attacker.example"),
    ("rebinding Host on /init_communicator/", "POST", "/init_communicator/", INIT, REBIND, 421, "Host"),
    (
        "foreign Origin on /init_communicator/",
        "POST",
        "/init_communicator/",
        INIT,
        {"Origin": "http://rebind.attacker.example:8000"},
        421,
        "Origin",
    ),
    ("null Origin", "POST", "/infer/", _infer(), {"Origin": "null"}, 421, "Origin"),
    ("slashless path with a foreign Host", "POST", "/infer", _infer(), REBIND, 421, "Host"),
    ("slashless path", "POST", "/infer", _infer(), {}, 404, "the endpoint is /infer/"),
    (
        "Content-Length and Transfer-Encoding",
        "POST",
        "/infer/",
        b"0\r\n\r\n",
        {"Content-Length": "5", "Transfer-Encoding": "chunked"},
        400,
        "ambiguous framing",
    ),
    (
        "unknown tensor first of many",
        "POST",
        "/update_weights/",
        lambda: _many_buckets(20).replace(b'"w0"', b'"nope.weight"'),
        {},
        422,
        "nope.weight: no such parameter",
    ),
    # fourth round: JSON text inside a body parsed within bounds, browsers' cross-site requests, encoded bodies
    (
        "schema as text holding a 5,000-digit number",
        "POST",
        "/infer/",
        _infer({"structured_outputs_json": '{"maximum": ' + "9" * 5000 + "}"}),
        {},
        400,
        "a number of 5000 characters",
    ),
    (
        "carried tools as text nested 3000 deep",
        "POST",
        "/infer/",
        _infer(messages=[{"role": "user", "content": "hi", "tools": "[" * 3000 + "]" * 3000}]),
        {},
        400,
        "nests deeper than",
    ),
    ("a page of another site, no Origin", "GET", "/health/", b"", {"Sec-Fetch-Site": "cross-site"}, 403, "Sec-Fetch"),
    ("a gzip-encoded body", "POST", "/infer/", _infer(), {"Content-Encoding": "gzip"}, 415, "uncompressed"),
]


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory):
    tiny = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    with limited_server(
        tiny, tmp_path_factory.mktemp("logs") / "rollout.log", "--max_sync_timeout_s", str(SYNC_CAP_S), key=KEY
    ) as (proc, url, port):
        with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
            assert client.post("/infer/", json=_infer({"max_tokens": 32})).status_code == 200  # warm-up
        IDLE.update(rss=memory_kb(proc.pid)["VmRSS"], fds=open_fds(proc.pid))  # the figures both tests hold to
        yield proc, url, port


def _send(client: httpx.Client, path: str, body) -> httpx.Response:
    if path == "/nope/":
        return client.get(path)
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"Content-Type": "application/json"})
    return client.post(path, json=body)


def test_the_hostile_set_gets_4xx_within_bounded_memory(hostile_server):
    proc, url, port = hostile_server
    idle_kb = IDLE["rss"]
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        assert client.post("/infer/", json=_infer()).status_code == 200
        assert httpx.post(url + "/infer/", json=_infer(), timeout=10).status_code == 401  # no key
        wrong = []
        for kind, name, path, body, status, words in CASES:
            resp = _send(client, path, body)  # one keep-alive connection for all: it must survive each answer
            if resp.status_code != status or (status >= 400 and words not in resp.json().get("error", "")):
                wrong.append((kind, name, resp.status_code, resp.text[:200]))
            if status >= 400:
                assert resp.headers["content-type"] == "application/json", name
        assert not wrong, wrong
        leaks = [
            _send(client, "/infer/", _infer({"structured_outputs_json": p})).json()["error"]
            for p in ("/etc/passwd", "/nope/s.json")
        ]
        assert leaks[0] == leaks[1] and "root:" not in leaks[0]  # no file read, no existence oracle
        refused = _send(client, "/infer/", _infer({"structured_outputs_json": {"type": "objectx", "secret": "s3cr3t"}}))
        assert "s3cr3t" not in refused.text  # the schema is not repeated back
        _silent_store_answers_within_the_cap(client)
        _a_disconnected_request_leaves_the_engine_free(client, port)
        assert client.get("/health/").json() == {"status": "ok"}
    assert proc.poll() is None
    peak_kb = memory_kb(proc.pid)["VmHWM"]
    print(f"\nhostile set: {len(CASES)} cases + 4 checks; idle RSS {idle_kb} kB, peak RSS {peak_kb} kB")
    assert peak_kb <= 2 * idle_kb, f"peak RSS {peak_kb} kB above twice the idle {idle_kb} kB"


def _round3(url: str, name: str, method: str, path: str, body, headers: dict) -> httpx.Response:
    """One request on a fresh connection (some refusals close theirs)."""
    if callable(body):
        body = body()
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {**AUTH, "Content-Type": "application/json", **headers}
    if "Transfer-Encoding" in headers:  # httpx frames bodies itself: send this one as raw bytes
        return _raw_request(url, method, path, body, headers)
    with httpx.Client(base_url=url, timeout=120) as client:
        return client.request(method, path, headers=headers, **kwargs)


def _raw_request(url: str, method: str, path: str, body: bytes, headers: dict) -> httpx.Response:
    port = int(url.rsplit(":", 1)[1])
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):  # the server answers once and closes
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    raw_headers, _, content = rest.partition(b"\r\n\r\n")
    parsed = dict(line.decode().split(": ", 1) for line in raw_headers.split(b"\r\n") if b": " in line)
    return httpx.Response(int(status_line.split()[1]), headers=parsed, content=content)


def test_the_third_round_gets_4xx_with_health_rss_and_fds_in_bounds(hostile_server):
    proc, url, _ = hostile_server
    assert health_s(url, KEY) < 1.0
    idle_kb, idle_fds = IDLE["rss"], IDLE["fds"]  # at start-up, after one warm-up call
    wrong, slow, peaks = [], [], {}
    for name, method, path, body, headers, status, words in ROUND3:
        with open(f"/proc/{proc.pid}/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM: each case's own peak
        resp = _round3(url, name, method, path, body, headers)
        answer = resp.json() if resp.headers.get("content-type") == "application/json" else None
        error = answer.get("error", "") if isinstance(answer, dict) else ""
        if resp.status_code != status or words not in error or "location" in resp.headers:
            wrong.append((name, resp.status_code, resp.text[:300]))
        took = health_s(url, KEY)
        if took >= 1.0:
            slow.append((name, took))
        peaks[name] = rss = memory_kb(proc.pid)["VmHWM"]
        assert rss <= 2 * idle_kb, f"{name}: peak RSS {rss} kB above twice the idle {idle_kb} kB"
    assert not wrong, wrong
    assert not slow, slow
    _a_new_init_wins_over_stale_ones(url)
    fds = fds_settle(proc.pid, idle_fds, within_s=15)
    assert fds <= idle_fds + 2, f"{fds} descriptors, {idle_fds} when idle"
    top = sorted(peaks.items(), key=lambda kv: -kv[1])[:3]
    print(
        f"\nthird round: {len(ROUND3)} cases + 1 check; idle RSS {idle_kb} kB, idle fds {idle_fds}; highest "
        "peaks: " + ", ".join(f"{name} {kb} kB" for name, kb in top)
    )


def _a_new_init_wins_over_stale_ones(url: str) -> None:
    """Two inits waiting on a store that never answers; the trainer's init right after gets its own answer (the
    store's silence, 424), not 429 behind them."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        body = {**INIT, "port": listener.getsockname()[1], "timeout_s": 600}
        stale = [
            threading.Thread(
                target=httpx.post,
                args=(url + "/init_communicator/",),
                kwargs={"json": body, "headers": AUTH, "timeout": 30},
            )
            for _ in range(2)
        ]
        for t in stale:
            t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        resp = httpx.post(url + "/init_communicator/", json=body, headers=AUTH, timeout=30)
        assert resp.status_code == 424 and f"within {SYNC_CAP_S:g}s" in resp.json()["error"], resp.text
        assert time.monotonic() - t0 < SYNC_CAP_S + 3
        for t in stale:
            t.join(30)


def _silent_store_answers_within_the_cap(client: httpx.Client) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)  # accepts (the kernel completes the handshake) and never answers
        body = {**INIT, "port": listener.getsockname()[1], "timeout_s": 600}
        t0 = time.monotonic()
        resp = client.post("/init_communicator/", json=body)
        took = time.monotonic() - t0
    assert resp.status_code == 424 and f"within {SYNC_CAP_S:g}s" in resp.json()["error"], resp.text
    assert took < SYNC_CAP_S + 3


def _a_disconnected_request_leaves_the_engine_free(client: httpx.Client, port: int) -> None:
    data = json.dumps(_infer({"max_tokens": 1000, "temperature": 1.0})).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        f"POST /infer/ HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\nContent-Type: "
        f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    threading.Event().wait(0.5)  # let it reach the engine (the unit test checks the timing with events)
    sock.close()
    t0 = time.monotonic()
    assert client.post("/infer/", json=_infer({"max_tokens": 2})).status_code == 200
    assert time.monotonic() - t0 < 5
