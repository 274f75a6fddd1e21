"""RolloutClient without a server: splitting, re-ordering, retries that end, and `grpokit rollout` option checks."""

from __future__ import annotations

import socket
import time

import pytest

from grpokit.engines.client import RolloutClient, split_requests
from grpokit.engines.client_calls import output_positions
from grpokit.engines.client_transport import endpoints_from
from grpokit.errors import ConfigError, ServerError
from grpokit.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    RequestConfig,
    RolloutInferRequest,
    RolloutOutput,
)
from grpokit.server.cli import options_from_argv
from grpokit.server.options import ServerOptions


def _req(prompt_id: str, request_id: str) -> RolloutInferRequest:
    return RolloutInferRequest(messages=[{"role": "user", "content": "q"}], prompt_id=prompt_id, request_id=request_id)


def _out(request_id: str) -> RolloutOutput:
    choice = ChatCompletionResponseChoice(
        message={"role": "assistant", "content": ""}, finish_reason="stop", token_ids=[]
    )
    return RolloutOutput(response=ChatCompletionResponse(choices=[choice]), messages=[], request_id=request_id)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_split_keeps_prompt_groups_together_and_balances():
    # groups in first-seen order: a (idx 0,2), b (1,3), c (4), d (5,6,7); 2 servers
    # a -> server 0 (2), b -> server 1 (2), c -> server 0 (3: the tie goes to the first), d -> server 1 (5)
    pids = ["a", "b", "a", "b", "c", "d", "d", "d"]
    requests = [_req(p, f"r{i}") for i, p in enumerate(pids)]
    assert split_requests(requests, 2) == [[0, 2, 4], [1, 3, 5, 6, 7]]
    assert split_requests(requests, 1) == [list(range(8))]


def test_positions_follow_request_ids_with_several_outputs_per_request():
    requests = [_req("a", "r0"), _req("a", "r1"), _req("b", "r2")]
    idx = [0, 2]  # this server got requests 0 and 2; request r2 produced two outputs
    assert output_positions(requests, idx, [_out("r0"), _out("r2"), _out("r2")]) == [0, 2, 2]
    # an output whose id is unknown stays with the request before it
    assert output_positions(requests, idx, [_out("r0"), _out("zz"), _out("r2")]) == [0, 0, 2]


def test_endpoints_from_hosts_ports_and_urls():
    eps = endpoints_from(hosts=["10.0.0.1", "10.0.0.2"], ports=[9000])
    assert [e.label for e in eps] == ["10.0.0.1:9000", "10.0.0.2:9000"]
    assert endpoints_from(base_urls=["http://h:81/"])[0].base_url == "http://h:81"
    with pytest.raises(ConfigError, match="one port, or one per host"):
        endpoints_from(hosts=["a", "b", "c"], ports=[1, 2])


def test_unreachable_at_start_names_host_and_port_within_the_timeout():
    port = _closed_port()
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=f"127.0.0.1:{port}.*--port {port}"):
        RolloutClient(hosts=["127.0.0.1"], ports=[port], timeout=1.5)
    assert time.monotonic() - t0 < 5


def test_dead_server_raises_after_bounded_retries():
    port = _closed_port()
    client = RolloutClient(hosts=["127.0.0.1"], ports=[port], timeout=10, backoff_s=0.05, wait=False)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=f"127.0.0.1:{port} did not answer .* after 4 attempt"):
        client.infer_trajectories([_req("a", "r0")], RequestConfig(max_tokens=2))
    assert time.monotonic() - t0 < 5  # 3 retries: 0.05 + 0.1 + 0.2 s of backoff
    client.close()


def _scripted(statuses: list[int]):
    """An httpx transport that answers with ``statuses`` in turn (then 200), counting the calls."""
    import httpx

    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        status = statuses[len(calls) - 1] if len(calls) <= len(statuses) else 200
        return httpx.Response(status, json={"ok": len(calls)} if status == 200 else {"error": "busy"})

    return handler, calls


@pytest.mark.parametrize(
    "statuses, attempts, answered",
    [
        ([503, 502], 3, True),  # transient twice, then the answer
        ([429] * 5, 6, True),  # busy: retried past max_retries, until the deadline
        ([503] * 4, 4, False),  # 1 + 3 retries, all unavailable: a ServerError naming the attempts
        ([400], 1, False),  # a refusal is final
    ],
)
def test_sync_and_async_requests_share_one_retry_policy(statuses, attempts, answered):
    import asyncio

    import httpx

    client = RolloutClient(hosts=["127.0.0.1"], ports=[_closed_port()], timeout=30, backoff_s=0.001, wait=False)
    for use_async in (False, True):
        handler, calls = _scripted(statuses)
        if use_async:

            async def call():
                async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
                    return await client._request_async(http, 0, "/x/", {})

            run = lambda: asyncio.run(call())  # noqa: E731
        else:
            client._http = httpx.Client(transport=httpx.MockTransport(handler))
            run = lambda: client._request(0, "POST", "/x/", {})  # noqa: E731
        if answered:
            assert run() == {"ok": attempts}
        else:
            with pytest.raises(ServerError, match="refused" if statuses == [400] else f"after {attempts} attempt"):
                run()
        assert len(calls) == attempts, use_async
    client.close()


def test_rollout_options_refuse_an_open_unauthenticated_server(monkeypatch):
    monkeypatch.delenv("GRPOKIT_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="--host 0.0.0.0 .* --api_key"):
        options_from_argv(["--model", "m", "--host", "0.0.0.0"])
    assert options_from_argv(["--model", "m", "--host", "0.0.0.0", "--insecure"]).insecure
    assert options_from_argv(["--model", "m", "--host", "0.0.0.0", "--api_key", "k"]).api_key == "k"
    monkeypatch.setenv("GRPOKIT_API_KEY", "from-env")
    assert options_from_argv(["--model", "m", "--host", "10.1.2.3"]).api_key == "from-env"
    assert options_from_argv(["--model", "m", "--host", "::1"]).host == "::1"


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "m", "--engine", "sglang"], "--engine: invalid choice: 'sglang'"),
        (["--model", "m", "--max_turns", "3"], "--max_turns 3 needs --multi_turn_scheduler"),
        (["--model", "m", "--gym_env", "e"], "needs --multi_turn_scheduler gym_scheduler"),
        (["--model", "m", "--port", "70000"], "--port 70000"),
        (["--model", "m", "--max_batch_requests", "0"], "--max_batch_requests 0"),
        (["--model", "m", "--bogus"], "unknown option --bogus; did you mean"),
        (["--model", "m", "--vllm_tensor_parallel_size", "2"], "tensor parallelism is not implemented yet"),
        (
            ["--model", "m", "--vllm_data_parallel_size", "2"],
            "not implemented yet in grpokit rollout; start one grpokit rollout per device",
        ),
        (["--model", "m", "--vllm_max_lora_rank", "0"], "--vllm_max_lora_rank 0: must be at least 1"),
        (
            ["--model", "m", "--engine", "transformers", "--vllm_max_loras", "8"],
            "--vllm_max_loras 8 applies to --engine vllm --vllm_enable_lora true only",
        ),
        (
            ["--model", "m", "--engine", "transformers", "--vllm_gpu_memory_utilization", "0.5"],
            "applies to --engine vllm only",
        ),
        (
            ["--model", "m", "--engine", "transformers", "--vllm_enforce_eager", "true"],
            "--vllm_enforce_eager true applies to --engine vllm only",
        ),
        (["--model", "m", "--vllm_gpu_memory_utilization", "1.5"], "must be in (0, 1]"),
        (["--model", "m", "--max_sync_timeout_s", "1e9"], "--max_sync_timeout_s"),
        ([], "--model"),
    ],
)
def test_rollout_option_errors_are_one_line(argv, words, monkeypatch):
    monkeypatch.setattr("grpokit.server.cli.vllm_installed", lambda: False)
    with pytest.raises(ConfigError) as e:
        options_from_argv(argv)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_engine_defaults_to_vllm_when_installed_and_a_missing_vllm_is_one_line(monkeypatch):
    monkeypatch.setattr("grpokit.server.cli.vllm_installed", lambda: True)
    vllm = options_from_argv(
        [
            "--model",
            "m",
            "--vllm_gpu_memory_utilization",
            "0.5",
            "--vllm_max_model_len",
            "512",
            "--vllm_enable_prefix_caching",
            "false",
            "--vllm_enforce_eager",
            "true",
        ]
    )
    assert vllm.engine == "vllm" and vllm.vllm_settings() == {
        "gpu_memory_utilization": 0.5,
        "enable_prefix_caching": False,
        "enforce_eager": True,
    }
    assert vllm.vllm_max_model_len == 512
    monkeypatch.setattr("grpokit.server.cli.vllm_installed", lambda: False)
    assert options_from_argv(["--model", "m"]).engine == "transformers"
    with pytest.raises(ConfigError, match="vllm package is not installed") as e:
        options_from_argv(["--model", "m", "--engine", "vllm"])
    assert "\n" not in str(e.value)


def test_a_folder_named_vllm_is_not_an_installed_vllm(tmp_path, monkeypatch):
    import importlib.util

    from grpokit.server.cli import vllm_installed

    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin is not None:
        pytest.skip("vllm is installed here")
    (tmp_path / "vllm").mkdir()  # what pytest's rootdir puts on the path: tests/vllm
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not vllm_installed()
    assert options_from_argv(["--model", "m"]).engine == "transformers"


def test_a_vllm_server_with_lora_loads_four_versions_unless_told():
    """vLLM's max_loras: 4 (a trainer's --max_staleness up to 3), else --vllm_max_loras; vLLM without LoRA: none."""
    assert ServerOptions(model="m", engine="vllm", vllm_enable_lora=True).vllm_lora() == (16, 4)
    assert ServerOptions(model="m", engine="vllm", vllm_enable_lora=True, vllm_max_loras=6).vllm_lora() == (16, 6)
    assert ServerOptions(model="m", engine="vllm").vllm_lora() is None
    with pytest.raises(ConfigError, match="--vllm_max_loras 0: must be at least 1"):
        ServerOptions(model="m", engine="vllm", vllm_enable_lora=True, vllm_max_loras=0)
