"""vLLM colocate at top_p 0.8 and at top_k 20 (issue 32): vLLM's processed logprobs are renormalised over its kept
set, and the trainer rebuilds that set from its own logits, so the rollout IS weights stay at 1 (they were the
kept mass, about 0.8 at top_p 0.8, with full-vocabulary trainer logps)."""

from __future__ import annotations

import json

import pytest
import torch

from grpokit.config.parse import parse_train_args
from grpokit.rewards import ORM, orms

pytestmark = pytest.mark.vllm


class LengthReward(ORM):
    def __call__(self, completions, **kwargs):
        return [len(c) / 50.0 for c in completions]


if "test_length" not in orms:
    orms["test_length"] = LengthReward


@pytest.mark.parametrize("truncation", [["--top_p", "0.8"], ["--top_k", "20"]], ids=["top_p", "top_k"])
def test_vllm_weights_stay_at_one_under_truncated_sampling(tiny128, tmp_path, truncation):
    from grpokit.engines.vllm_engine import VllmEngine
    from grpokit.pipeline.train import run_train

    torch.set_num_threads(1)
    out = tmp_path / "run"
    cfg = parse_train_args(
        [
            "--model",
            str(tiny128),
            "--tuner_type",
            "full",  # written for full fine-tuning (the default is lora)
            "--dataset",
            "builtin:arithmetic",
            "--reward_funcs",
            "test_length",
            "--max_steps",
            "2",
            "--num_generations",
            "4",
            "--per_device_train_batch_size",
            "8",
            "--max_completion_length",
            "12",
            "--learning_rate",
            "5e-3",
            "--beta",
            "0",
            "--torch_dtype",
            "float32",
            "--temperature",
            "0.9",
            "--rollout_importance_sampling_mode",
            "token_truncate",
            "--use_vllm",
            "true",
            "--vllm_mode",
            "colocate",
            "--vllm_enforce_eager",
            "true",
            "--vllm_max_model_len",
            "512",
            "--vllm_gpu_memory_utilization",
            "0.3",
            "--output_dir",
            str(out),
            "--save_final_model",
            "false",
            "--plots",
            "false",
            "--disable_tqdm",
            "true",
            *truncation,
        ]
    )
    trainer = run_train(cfg)
    try:
        assert isinstance(trainer.engine, VllmEngine)
        rows = [r for r in map(json.loads, (out / "logging.jsonl").read_text().splitlines()) if "loss" in r]
        print("weights:", [(r["step"], r["rollout_correction/is_weight_mean"], r["mismatch/max_abs"]) for r in rows])
        assert len(rows) == 2
        for row in rows:
            assert row["rollout_correction/is_weight_mean"] == pytest.approx(1.0, abs=0.01)
            assert row["mismatch/ratio_mean"] == pytest.approx(1.0, abs=0.01)
    finally:
        trainer.engine.close()
