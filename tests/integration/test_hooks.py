"""Every documented GRPOTrainer hook (docs/plugins.md, "The hooks"), overridden in one tiny run: each is called
as often as documented and its effect reaches the batch, the loss or the logs."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from support import flags

pytestmark = pytest.mark.slow


def test_every_documented_hook_takes_effect(tiny_model_dir, math_jsonl, tmp_path):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train
    from grpokit.trainers.factory import TrainerFactory
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    calls: Counter = Counter()
    seen: dict = {"entropy_flags": [], "micro_row_ids": [], "losses": []}

    class Hooked(GRPOTrainer):
        def _prepare_inputs(self, prompts, rollout=None):
            calls["prepare_inputs"] += 1
            window = super()._prepare_inputs(prompts, rollout)
            window.batch.extra["row_id"] = torch.arange(len(window.batch))  # [N], must follow each micro-batch
            window.metrics["hooks/window"] = 1.0
            return window

        def _generate_completions(self, requests):
            calls["generate"] += 1
            seen["requests"] = len(requests)
            return super()._generate_completions(requests)

        def _score_completions(self, requests, outputs):
            calls["score"] += 1
            scores = super()._score_completions(requests, outputs)  # [N, F]
            return torch.full_like(scores, 0.25)

        def _prepare_model_inputs(self, inputs):
            calls["model_inputs"] += 1
            return super()._prepare_model_inputs(inputs)

        def _get_per_token_logps_and_entropies(self, model, inputs, compute_entropy=False):
            calls["logps"] += 1
            seen["entropy_flags"].append(compute_entropy)
            return super()._get_per_token_logps_and_entropies(model, inputs, compute_entropy)

        def _compute_loss_and_metrics(self, model, inputs):
            calls["loss"] += 1
            seen["micro_row_ids"].append(inputs.extra["row_id"].tolist())
            loss, metrics = super()._compute_loss_and_metrics(model, inputs)
            metrics["hooks/extra_metric"] = 2.0
            return loss, metrics

        def training_step(self, model, inputs):
            calls["training_step"] += 1
            loss = super().training_step(model, inputs)
            seen["losses"].append(loss)
            return loss

    out = tmp_path / "hooks"
    saved = dict(TrainerFactory.TRAINER_MAPPING)
    TrainerFactory.TRAINER_MAPPING["grpo"] = Hooked
    try:
        # one window of 8 completions (2 prompts × 4), trained as 2 micro-batches of 4, one optimizer step each:
        # the policy drifts inside the window, so the second micro-batch's old logps (one chunk of 4) are computed
        # before training; the first trains with the window's own policy and needs none
        trainer = run_train(
            parse_train_args(
                flags(
                    {"--model": tiny_model_dir, "--dataset": math_jsonl, "--output_dir": out},
                    "--tuner_type full --reward_funcs accuracy --num_generations 4 --per_device_train_batch_size 4",
                    "--steps_per_generation 2 --max_steps 2 --max_completion_length 8 --beta 0",
                    "--torch_dtype float32 --logging_steps 1 --save_steps 100 --seed 0 --disable_tqdm true",
                )
            )
        )
    finally:
        TrainerFactory.TRAINER_MAPPING.clear()
        TrainerFactory.TRAINER_MAPPING.update(saved)
    assert trainer.state.global_step == 2
    assert calls == {
        "prepare_inputs": 1,
        "generate": 1,
        "score": 1,
        "training_step": 2,
        "loss": 2,
        "logps": 3,
        "model_inputs": 3,
    }  # logps: 1 old-logps chunk, then one per loss
    assert seen["requests"] == 8
    assert seen["entropy_flags"][:1] == [False]  # old logps ask for no entropies
    assert seen["micro_row_ids"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # extra rows travel with their micro-batch
    assert all(isinstance(x, torch.Tensor) and x.ndim == 0 for x in seen["losses"])
    rows = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["hooks/window"] == 1.0  # the window's metrics, logged with each of its steps
        assert r["hooks/extra_metric"] == 2.0  # the loss's metrics
        assert r["reward"] == 0.25 and r["reward_std"] == 0.0  # the overridden scores
        assert r["rewards/accuracy/mean"] == 0.25
        assert r["loss"] == pytest.approx(float(seen["losses"][r["step"] - 1]), abs=1e-6)
