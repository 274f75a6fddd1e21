"""Property-based fuzzing of every rollout-server endpoint with Schemathesis, from the OpenAPI schema the server
serves at /openapi.json (ms-swift's routes included: server/swift_routes.py).

The app runs in process (ASGI, Starlette's TestClient) on the tiny model with the transformers engine, context
capped at 96 tokens and at most 4 requests per call, so that the bodies that validate generate in milliseconds.
Weight-sync rendezvous never leave the process: the store connection is replaced by one that fails at once (a
fuzzer must not dial the hosts it invents), and so is the store that ms-swift's design has the server host (nor
listen on the ports it invents). Each endpoint gets 200 generated examples (bodies that fit the schema
and bodies that do not, plus Schemathesis' coverage cases: other methods, missing and wrong-typed fields) with a
fixed seed; each must answer below 500, every error as JSON with an ``error`` field (a one-line string; under
``/v1/``, OpenAI's ``{"message": line, ...}``), and ``/health/`` must answer after each one.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from grpokit.errors import ServerError
from grpokit.server import swift_weights, weight_sync
from grpokit.server.app import create_app
from grpokit.server.state import ServerOptions, ServerState, build_state

pytestmark = pytest.mark.slow
EXAMPLES = 200
NOT_IMPLEMENTED = {"/update_adapter_flattened_param/", "/update_adapter_param/"}  # ms-swift's LoRA routes: 501
COUNTS: Counter = Counter()


def _openapi() -> dict:
    """The document the server serves; the routes do not depend on the model, so a stub state gives it."""
    return create_app(ServerState(ServerOptions(model="stub"), None, None)).app.app.app.app.openapi()


schema = schemathesis.openapi.from_dict(_openapi())
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=EXAMPLES)


def _no_network(**kwargs):
    raise ServerError(f"weight sync: rendezvous with {kwargs['store_host']}:{kwargs['store_port']} refused (fuzz)")


def _no_swift_group(host, port, *args, **kwargs):
    raise RuntimeError(f"weight sync: no store on {host}:{port} (fuzz)")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(weight_sync.Communicator, "create", staticmethod(_no_network))
        mp.setattr(weight_sync, "local_address_towards", lambda host, port: "127.0.0.1")
        mp.setattr(swift_weights, "open_group", _no_swift_group)  # ms-swift's design: the server hosts the store
        options = ServerOptions(
            model=str(tiny_model_dir),
            torch_dtype="float32",
            max_batch_requests=4,
            max_body_mb=1,
            vllm_max_model_len=96,
            max_sync_timeout_s=2,
        )
        with TestClient(
            create_app(build_state(options)), raise_server_exceptions=False, base_url="http://127.0.0.1"
        ) as client:
            yield client


def _send(client: TestClient, case):
    kwargs = case.as_transport_kwargs(base_url="http://127.0.0.1")
    kwargs.pop("cookies", None)
    return client.request(**kwargs)


@schema.parametrize()
@settings(
    max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)
def test_every_endpoint_answers_below_500_with_json_errors(case, server):
    COUNTS[case.operation.label] += 1
    response = _send(server, case)
    not_implemented = response.status_code == 501 and case.path in NOT_IMPLEMENTED  # said so, not a failure
    assert response.status_code < 500 or not_implemented, (case.method, case.path, case.body, response.text[:300])
    if response.status_code >= 400:
        assert _error_line(response, case.path), response.text[:300]
    assert server.get("/health/").json() == {"status": "ok"}


def _error_line(response, path: str) -> str:
    """The answer's one-line error: ``error`` itself, or under /v1/ OpenAI's ``error.message``."""
    body = response.json()
    error = body.get("error") if isinstance(body, dict) else None
    if path.startswith("/v1/") and isinstance(error, dict):
        error = error.get("message")
    return error if isinstance(error, str) else ""


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
RAW_BODIES = st.one_of(
    st.binary(max_size=512),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
)
CONTENT_TYPES = st.sampled_from(
    [
        "application/json",
        "application/json; charset=latin-1",
        "text/plain",
        "",
        "application/problem+json",
        "multipart/form-data",
    ]
)
ROUTES = [
    ("GET", "/health/"),
    ("GET", "/get_engine_type/"),
    ("POST", "/infer/"),
    ("POST", "/init_communicator/"),
    ("POST", "/update_weights/"),
    ("POST", "/close_communicator/"),
    ("POST", "/reset_prefix_cache/"),
    ("POST", "/score_tokens/"),
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/health"),  # ms-swift's routes (server/swift_routes.py)
    ("POST", "/get_engine_type/"),
    ("POST", "/update_flattened_params/"),
    ("POST", "/process_weights_after_loading/"),
]


@pytest.mark.parametrize("method, path", ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_raw_bodies_of_any_bytes_and_type_get_json_answers(server, method, path):
    """The body-less endpoints have too few schema cases for 200 examples: every endpoint also gets 200
    arbitrary bodies (bytes, JSON of any shape, text with lone surrogates) under assorted content types."""

    @given(body=RAW_BODIES, ctype=CONTENT_TYPES)
    @settings(
        max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def check(body: bytes, ctype: str) -> None:
        COUNTS[f"raw {method} {path}"] += 1
        headers = {"Content-Type": ctype} if ctype else {}
        response = server.request(method, path, content=body, headers=headers)
        assert response.status_code < 500, (body[:200], ctype, response.text[:300])
        if response.status_code >= 400:
            assert _error_line(response, path), response.text[:300]
        assert server.get("/health/").json() == {"status": "ok"}

    check()


def teardown_module():
    print("\nexamples per operation:", dict(COUNTS))
