"""A real rollout server under bad input, a missing key, a crash mid-use, and bad start-up options."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from cli_process import free_port
from test_server_support import rollout_server

from grpokit.engines.client import RolloutClient
from grpokit.errors import ServerError
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.testing import build_tiny_model

pytestmark = pytest.mark.slow

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def guarded(tiny, tmp_path_factory):
    """API key from the environment, at most 8 requests per call, bodies up to 0.05 MB."""
    with rollout_server(
        tiny,
        tmp_path_factory.mktemp("logs"),
        "--max_batch_requests",
        "8",
        "--max_body_mb",
        "0.05",
        env={"GRPOKIT_API_KEY": KEY},
    ) as s:
        yield s


def _msg(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


JSON = {"Content-Type": "application/json", **AUTH}
BAD = [
    ("bad JSON", {"content": b'{"requests": [{"messages": '}, JSON, 422, "not valid JSON"),
    (
        "wrong type",
        {"json": {"requests": [_msg("x")], "request_config": {"temperature": "hot"}}},
        AUTH,
        422,
        "request_config.temperature",
    ),
    ("unknown field", {"json": {"requests": [{**_msg("x"), "priority": 1}]}}, AUTH, 422, "requests.0.priority"),
    ("oversized body", {"json": {"requests": [_msg("z" * 60_000)]}}, AUTH, 413, "--max_body_mb"),
    (
        "too many requests",
        {"json": {"requests": [_msg(str(i)) for i in range(9)]}},
        AUTH,
        413,
        "--max_batch_requests 8",
    ),
    ("missing key", {"json": {"requests": [_msg("x")]}}, {}, 401, "API key"),
    ("wrong key", {"json": {"requests": [_msg("x")]}}, {"Authorization": "Bearer nope"}, 401, "API key"),
]


@pytest.mark.parametrize("case, kwargs, headers, status, words", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(guarded, case, kwargs, headers, status, words):
    resp = httpx.post(guarded.url + "/infer/", headers=headers, timeout=30, **kwargs)
    assert resp.status_code == status, resp.text
    assert words in resp.json()["error"]
    assert guarded.healthy(AUTH)
    good = httpx.post(
        guarded.url + "/infer/",
        headers=AUTH,
        timeout=60,
        json={"requests": [_msg("ok")], "request_config": {"max_tokens": 2}},
    )
    assert good.status_code == 200 and len(good.json()) == 1


def test_client_with_the_key_works_and_without_it_is_told_why(guarded):
    client = RolloutClient(base_urls=[guarded.url], api_key=KEY, timeout=30)
    try:
        outs = client.infer_trajectories([RolloutInferRequest(**_msg("hi"))], RequestConfig(max_tokens=2))
        assert len(outs) == 1
        # 20 requests > --max_batch_requests 8: the client splits them into calls the server accepts
        many = [RolloutInferRequest(**_msg(f"q{i}"), request_id=f"r{i}") for i in range(20)]
        assert [o.request_id for o in client.infer_trajectories(many, RequestConfig(max_tokens=2))] == [
            f"r{i}" for i in range(20)
        ]
    finally:
        client.close()
    with pytest.raises(ServerError, match=f"127.0.0.1:{guarded.port} rejected the API key"):
        RolloutClient(base_urls=[guarded.url], api_key="wrong", timeout=10)


# Guards against a hang only: each wait below ends on an event long before, and the client's own timeout
# (CLIENT_TIMEOUT_S) is far beyond them, so an error that came only when the client gave up reads as a hang.
GUARD_S = 120.0
CLIENT_TIMEOUT_S = 1200.0


def _inflight(server) -> int:
    return httpx.get(server.url + "/get_engine_type/", timeout=10).json()["inflight_requests"]


def _in_thread(fn) -> tuple[threading.Event, dict]:
    """Run ``fn`` in a daemon thread; the event is set when it returned or raised (the error under 'error')."""
    done, caught = threading.Event(), {}

    def run() -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - inspected by the caller
            caught["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    return done, caught


_CLAIMER = """
import sys
from grpokit.engines.client import RolloutClient
from grpokit.errors import ServerError
try:
    client = RolloutClient(base_urls=[sys.argv[1]], api_key=sys.argv[2], timeout=30, claim=True)
except ServerError as e:
    print("refused", e, flush=True)
    sys.exit(3)
print("claimed", flush=True)
sys.stdin.readline()  # held until the test says go; then exits without closing the client (atexit releases)
"""


def test_one_trainer_per_server_from_outside(guarded):
    """Trainer processes: the first claims the server; a second is refused up front with one line naming the
    first's pid; an unclaimed client cannot sample meanwhile; once the first exits, the next claims at once."""
    cmd = [sys.executable, "-c", _CLAIMER, guarded.url, KEY]
    first = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "claimed"
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120, input="")
        assert second.returncode == 3, second.stderr[-2000:]
        assert f"claimed by another trainer (pid {first.pid}" in second.stdout and "Traceback" not in second.stderr
        r = httpx.post(guarded.url + "/infer/", json={"requests": [_msg("x")]}, headers=AUTH, timeout=30)
        assert r.status_code == 409 and "belongs to another trainer" in r.json()["error"]
        first.communicate("go\n", timeout=60)
    finally:
        first.kill()
        first.wait()
    r = httpx.post(guarded.url + "/claim/", json={"trainer": "run-next-trainer"}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text  # released at the first's exit: claimed at once
    httpx.post(guarded.url + "/release/", json={"trainer": "run-next-trainer"}, headers=AUTH, timeout=30)


def test_server_killed_mid_use_raises_server_error_without_hanging(tiny, tmp_path):
    with rollout_server(tiny, tmp_path) as server:
        client = RolloutClient(base_urls=[server.url], timeout=CLIENT_TIMEOUT_S, backoff_s=0.2)
        model = torch.nn.Linear(2, 2)  # never reaches the server: the sync fails on the first call
        requests = [RolloutInferRequest(**_msg(f"long {i}")) for i in range(64)]
        done, caught = _in_thread(
            lambda: client.infer_trajectories(requests, RequestConfig(max_tokens=1000, temperature=1.0))
        )
        # kill only once the server is inside /infer/ with the whole batch (it answers while it generates)
        deadline = time.monotonic() + GUARD_S
        while _inflight(server) != len(requests):
            assert not done.is_set(), f"the batch ended before the server was seen serving it: {caught}"
            assert time.monotonic() < deadline, "the server never took the batch"
            time.sleep(0.02)
        server.proc.kill()
        server.proc.wait(timeout=30)
        assert done.wait(GUARD_S), "the client hung after the server died"
        error = caught.get("error")
        assert isinstance(error, ServerError), caught
        assert f"127.0.0.1:{server.port}" in str(error)
        assert "did not finish" not in str(error), error  # the dropped connection ended it, not the timeout
        done, caught = _in_thread(lambda: client.sync_weights(model))
        assert done.wait(GUARD_S), "the weight sync hung on the dead server"
        assert isinstance(caught.get("error"), ServerError), caught
        assert f"127.0.0.1:{server.port}" in str(caught["error"]) and "did not finish" not in str(caught["error"])
        client._http.close()


def test_unreachable_at_start_names_host_and_port():
    port = free_port()
    with pytest.raises(ServerError, match=f"127.0.0.1:{port} is not reachable .*--host 127.0.0.1 --port {port}"):
        RolloutClient(hosts=["127.0.0.1"], ports=[port], timeout=2)


def test_cli_refuses_to_expose_a_server_without_a_key(tiny):
    env_cmd = [sys.executable, "-m", "grpokit", "rollout", "--model", str(tiny), "--host", "0.0.0.0"]
    proc = subprocess.run(
        env_cmd, capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--api_key" in lines[0] and "--insecure" in lines[0], proc.stderr
