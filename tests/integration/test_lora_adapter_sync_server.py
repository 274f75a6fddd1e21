"""Adapter-only weight sync against a real rollout server (tiny model, transformers engine, float32): a rollout
that spans a sync carries each token's version and samples every token from its own version's weights over the
whole prefix; a 6-step LoRA run with --max_staleness 2 keeps the rollout IS weight at 1; a synchronous run trains
exactly as a merged-sync run does; a corrupted or dropped adapter bucket stops the run at that step with one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import pytest
import torch
from support import lora_policy, shake_lora, token_logps, while_generating
from test_server_support import rollout_server
from test_server_sync_check import PLUGIN
from tiny_runs import tiny_run_args

from grpokit.engines.adapters import AdapterSync, adapter_tensors
from grpokit.engines.client import RolloutClient
from grpokit.errors import GrpokitError
from grpokit.modeling import load_tokenizer
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.template.encode import ChatTemplate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory, fault_file):
    env = {"GRPOKIT_TEST_SYNC_FAULT_FILE": str(fault_file)}
    args = ("--torch_dtype", "float32", "--external_plugins", str(PLUGIN))
    with rollout_server(tiny, tmp_path_factory.mktemp("logs"), *args, env=env) as s:
        yield s


def test_a_rollout_spanning_an_adapter_sync(tiny, server, one_torch_thread, fault_file):
    fault_file.write_text("none")
    new = lora_policy(tiny, 1)  # the policy: its adapter changes in place, its base stays (sent once)
    old = copy.deepcopy(new)
    lora = AdapterSync(True, 16, "the rollout server", keep=2)
    client = RolloutClient(base_urls=[server.url], timeout=60, partial_rollouts=True, lora=lora)
    try:
        client.set_policy_version(7)
        client.sync_weights(new)  # version 7: base and adapter
        first = client.last_sync_bytes
        requests = [RolloutInferRequest(messages=[{"role": "user", "content": f"count {i}"}]) for i in range(6)]
        got: list = []
        config = RequestConfig(max_tokens=600, temperature=1.0, logprobs=True)

        def sync_again() -> None:
            shake_lora(new)
            client.set_policy_version(8)
            client.sync_weights(new)  # adapter only: the base is held

        while_generating(server.url, lambda: got.extend(client.infer_trajectories(requests, config)), sync_again)
        assert client.last_sync_bytes * 10 < first  # the first sync carried the base
    finally:
        client.close()
    template = ChatTemplate(load_tokenizer(str(tiny)))
    spans = 0
    for req, out in zip(requests, got, strict=True):
        choice = out.response.choices[-1]
        versions, tokens = choice.weight_versions, choice.token_ids
        assert len(versions) == len(tokens) and versions == sorted(versions) and set(versions) <= {7, 8}
        engine = torch.tensor([x["logprob"] for x in choice.logprobs["content"]])
        prompt = template.encode_requests([req])[0]
        for version, model in ((7, old), (8, new)):
            idx = [i for i, v in enumerate(versions) if v == version]
            if idx:  # each token under its own version's weights over the whole prefix: no prefix reused
                torch.testing.assert_close(engine[idx], token_logps(model, prompt, tokens)[idx], atol=1e-4, rtol=1e-4)
        spans += len(set(versions)) == 2
    assert spans >= 1


def _run(tiny, server, out: Path, *extra: str):
    from grpokit.config.parse import parse_train_args  # not at the top: collection stays free of the trainer
    from grpokit.pipeline.train import run_train

    args = tiny_run_args(tiny, "builtin:arithmetic", out, "--tuner_type", "lora", "--lora_rank", "4")
    args += ["--reward_funcs", "accuracy", "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1"]
    args += ["--vllm_server_port", str(server.port), "--vllm_server_timeout", "60", "--report_to", "none"]
    args += ["--logging_steps", "1", "--rollout_importance_sampling_mode", "token_truncate", *extra]
    trainer = run_train(parse_train_args(args))
    rows = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    return trainer, [r for r in rows if "loss" in r]


def test_six_steps_at_staleness_two_keep_the_is_weight_at_one(tiny, server, fault_file, tmp_path):
    fault_file.write_text("none")
    six = ("--max_steps", "6", "--max_staleness", "2", "--learning_rate", "1e-2")
    trainer, rows = _run(tiny, server, tmp_path / "adapter", *six)
    assert len(rows) == 6
    for row in rows:  # the engine samples exactly the version each window is tagged with
        assert abs(row["rollout_correction/is_weight_mean"] - 1) <= 0.002, row
    adapter = sum(t.numel() * t.element_size() for _, t in adapter_tensors(trainer.policy))
    assert trainer.engine.last_sync_bytes == adapter  # the last sync carried the adapter alone


def test_adapter_sync_trains_as_the_merged_sync(tiny, tmp_path):
    """Each run on a fresh server (the server's sampling stream then starts alike) and synchronous (both runs sync
    at the same points): same completions, same losses."""
    runs = {}
    for name, extra in (("adapter", ()), ("merged", ("--vllm_enable_lora", "false"))):
        with rollout_server(tiny, tmp_path, "--torch_dtype", "float32") as fresh:
            trainer, rows = _run(tiny, fresh, tmp_path / name, "--max_steps", "2", "--learning_rate", "1e-2", *extra)
            runs[name] = (trainer.engine.last_sync_bytes, rows)
    assert runs["adapter"][0] * 5 < runs["merged"][0]
    assert len(runs["adapter"][1]) == len(runs["merged"][1]) == 2
    for a, m in zip(runs["adapter"][1], runs["merged"][1], strict=True):
        assert a["loss"] == pytest.approx(m["loss"], abs=1e-5)
        assert a["completions/mean_length"] == m["completions/mean_length"]
        assert a["reward"] == m["reward"]


@pytest.mark.parametrize("fault", ["corrupt", "drop"])
def test_a_broken_adapter_bucket_stops_the_run(tiny, server, fault_file, tmp_path, fault):
    fault_file.write_text(f"{fault}:0:2")  # the group's 2nd sync: the first adapter-only one (one bucket)
    with pytest.raises(GrpokitError) as info:
        _run(tiny, server, tmp_path / fault, "--max_steps", "3")
    other = {"trainer": "someone-else", "pid": 1, "host": "elsewhere"}  # the failed run gave the server back:
    assert httpx.post(server.url + "/claim/", json=other, timeout=10).status_code == 200  # another trainer gets it
    httpx.post(server.url + "/release/", json={"trainer": "someone-else"}, timeout=10)
    message = str(info.value)
    assert "\n" not in message and "lora_" in message, message
    if fault == "corrupt":  # the weight check names the tensor whose sums moved
        assert "does not hold the weights just sent" in message and "[sync after step 1;" in message, message
    else:  # the server refuses the version: the tensor did not arrive
        assert "did not arrive" in message, message
