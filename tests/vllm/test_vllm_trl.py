"""TRL's vLLM-colocate GRPO example with only the import renamed: ``use_vllm=True, vllm_mode="colocate"`` samples
with vLLM in the training process, and TRL's default importance-sampling correction of vLLM's logprobs
(``vllm_importance_sampling_correction``: sequence_mask, C = 3) is logged as rollout_correction/*."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from datasets import Dataset

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
from test_trl_api import logged, run  # noqa: E402

pytestmark = pytest.mark.vllm


def test_trl_vllm_colocate_example(tiny128, tmp_path):
    scope = run(
        """
        from trl import GRPOConfig, GRPOTrainer

        def reward_len(completions, **kwargs):
            return [-abs(6 - len(c[0]["content"])) for c in completions]

        args = GRPOConfig(ARGS, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
                          vllm_max_model_length=512)
        trainer = GRPOTrainer(model=MODEL, reward_funcs=reward_len, args=args, train_dataset=dataset)
        trainer.train()
    """,
        tiny128,
        tmp_path,
        dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": f"Say {i}."}]} for i in range(8)]),
    )
    rows = [r for r in logged(tmp_path) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("rollout_correction/kl" in r for r in rows)  # TRL's default IS correction, on with vLLM
    assert scope["trainer"].trainer.engine.engine_type == "vllm"
