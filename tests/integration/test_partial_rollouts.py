"""Partial rollouts against a real rollout server (tiny model, transformers engine, float32): a weight update with
``interrupt`` pauses the rows generating, they continue on the new weights, and each token carries the version
that sampled it. Checked against the two models themselves: every token's engine logprob is its own version's.
Then `grpokit train --max_staleness 2 --partial_rollouts true` trains on such trajectories."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from support import flags, server_flags
from test_server_support import rollout_server

from grpokit.engines.client import RolloutClient
from grpokit.modeling import load_causal_lm, load_tokenizer
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.template.encode import ChatTemplate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir  # the session's tiny model (tests/conftest.py), built once


@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    with rollout_server(tiny, tmp_path_factory.mktemp("logs"), "--torch_dtype", "float32") as s:
        yield s


def _inflight(url: str) -> int:
    return httpx.get(url + "/get_engine_type/", timeout=5).json().get("inflight_requests", 0)


def _logps(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_an_interrupting_update_continues_rows_on_the_new_weights(tiny, server, one_torch_thread):
    old = load_causal_lm(str(tiny), torch.float32)
    new = load_causal_lm(str(tiny), torch.float32)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    client = RolloutClient(base_urls=[server.url], timeout=60, partial_rollouts=True)
    try:
        client.set_policy_version(7)
        client.sync_weights(old)  # version 7: the weights as they are
        requests = [RolloutInferRequest(messages=[{"role": "user", "content": f"count {i}"}]) for i in range(6)]
        got: list = []
        worker = threading.Thread(
            target=lambda: got.extend(
                client.infer_trajectories(requests, RequestConfig(max_tokens=600, temperature=1.0, logprobs=True))
            )
        )
        worker.start()
        deadline = time.monotonic() + 30
        while _inflight(server.url) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # some tokens on the old weights
        client.set_policy_version(8)
        client.sync_weights(new)  # pauses the rows; they continue on version 8
        worker.join(120)
    finally:
        client.close()
    assert len(got) == 6
    template = ChatTemplate(load_tokenizer(str(tiny)))
    spans = 0
    for req, out in zip(requests, got, strict=True):
        choice = out.response.choices[-1]
        versions, tokens = choice.weight_versions, choice.token_ids
        assert versions is not None and len(versions) == len(tokens) and set(versions) <= {7, 8}
        assert versions == sorted(versions)  # old tokens first, then new ones
        engine = torch.tensor([x["logprob"] for x in choice.logprobs["content"]])
        prompt = template.encode_requests([req])[0]
        for version, model in ((7, old), (8, new)):
            idx = [i for i, v in enumerate(versions) if v == version]
            if idx:
                mine = _logps(model, prompt, tokens)[idx]
                torch.testing.assert_close(engine[idx], mine, atol=1e-4, rtol=1e-4)
        spans += len(set(versions)) == 2
    assert spans >= 1, [set(o.response.choices[-1].weight_versions) for o in got]  # a row spanned the update


def test_a_checked_sync_does_not_wait_for_the_rollout_in_flight(tiny, server, one_torch_thread):
    """With interrupt, the update, the check's read-back and its probe all run while the rows are paused: the
    checked sync returns while the rollout it interrupted is still generating."""
    from types import SimpleNamespace

    from grpokit.engines.sync_check.probe import sync

    new = load_causal_lm(str(tiny), torch.float32)
    client = RolloutClient(base_urls=[server.url], timeout=60, partial_rollouts=True)
    try:
        client.set_policy_version(20)
        client.sync_weights(new)  # the served weights are the trainer's from here on
        # 16 rows: a row of the tiny model may sample eos early, and the longest of 16 still runs when the sync
        # returns (with 4, all could end first, the decode loop dropping finished rows as it goes)
        requests = [RolloutInferRequest(messages=[{"role": "user", "content": f"go {i}"}]) for i in range(16)]
        got: list = []
        worker = threading.Thread(
            target=lambda: got.extend(client.infer_trajectories(requests, RequestConfig(max_tokens=900)))
        )
        worker.start()
        deadline = time.monotonic() + 30
        while _inflight(server.url) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        sync(client, new, SimpleNamespace(check_weight_sync=True), step=21)  # raises if the check fails
        assert worker.is_alive()  # the rollout it interrupted is still generating
        worker.join(180)
    finally:
        client.close()
    versions = [set(o.response.choices[-1].weight_versions) for o in got]
    assert len(got) == 16 and any(v == {20, 21} for v in versions), versions


def test_training_with_partial_rollouts_logs_mixed_trajectories(tiny, server, tmp_path):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    out = tmp_path / "partial"
    cfg = parse_train_args(
        flags(
            {"--model": tiny, "--output_dir": out},
            server_flags(server.port),
            "--tuner_type full --dataset builtin:arithmetic --reward_funcs accuracy --num_generations 4",
            "--per_device_train_batch_size 8 --max_completion_length 256 --save_final_model false --save_steps 100",
            "--torch_dtype float32 --max_steps 4 --max_staleness 2 --partial_rollouts true --log_completions true",
            "--plots false",
        )
    )
    run_train(cfg)
    logs = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs] == [1, 2, 3, 4]
    assert all("async/partial_trajectories" in r and r["async/staleness_max"] <= 2 for r in logs)
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert all(r["step"] - 1 - r["weight_version"] <= 2 for r in rows)
    print(
        "partial trajectories per step:",
        [r["async/partial_trajectories"] for r in logs],
        "staleness:",
        [r["async/staleness_max"] for r in logs],
    )
