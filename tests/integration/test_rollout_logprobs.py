"""--use_rollout_logprobs (slime's --use-rollout-logprobs, verl's bypass mode): the engine's logprobs of the sampled
tokens are the old policy's, so the window runs no old-logps forward; bad combinations are one clear error."""

from __future__ import annotations

import pytest
import torch
from support import flags

from grpokit.config.parse import parse_train_args
from grpokit.errors import ConfigError
from grpokit.trainers.batch import RolloutBatch
from grpokit.trainers.window import engine_old_logps
from grpokit.trainers.window_producer import WindowProducer


def _args(model_dir, data, out) -> list[str]:
    return flags(
        {"--model": model_dir, "--dataset": data, "--output_dir": out},
        "--tuner_type full --reward_funcs accuracy --num_generations 4 --per_device_train_batch_size 4",
        "--steps_per_generation 2 --max_completion_length 8 --learning_rate 1e-3 --torch_dtype float32 --beta 0",
        "--max_steps 4 --save_steps 100 --logging_steps 1 --seed 0 --disable_tqdm true",
    )


def _batch(rollout_logps: torch.Tensor | None) -> RolloutBatch:
    att = torch.ones(2, 5, dtype=torch.long)
    return RolloutBatch(
        input_ids=torch.zeros(2, 5, dtype=torch.long),
        attention_mask=att,
        position_ids=att.cumsum(-1) - 1,
        completion_mask=torch.tensor([[1.0, 1, 0], [1, 0, 0]]),
        truncated=torch.zeros(2, dtype=torch.bool),
        rollout_logps=rollout_logps,
    )


def test_engine_logps_are_the_old_logps_only_when_every_trained_token_has_one():
    nan = float("nan")
    full = torch.tensor([[-0.5, -1.0, nan], [-2.0, nan, nan]])  # NaN only past each row's trained tokens
    assert torch.equal(engine_old_logps(_batch(full), required=True), torch.tensor([[-0.5, -1.0, 0], [-2.0, 0, 0]]))
    gap = torch.tensor([[-0.5, nan, nan], [-2.0, nan, nan]])  # one trained token without a logprob
    assert engine_old_logps(_batch(gap), required=False) is None  # --async_generate: recompute instead
    with pytest.raises(ConfigError, match=r"no logprob for 1 of the 3 trained tokens.*--use_rollout_logprobs false"):
        engine_old_logps(_batch(gap), required=True)
    with pytest.raises(ConfigError, match="no logprob for 3 of the 3"):
        engine_old_logps(_batch(None), required=True)


def test_rollout_is_beside_it_is_refused(tiny_model_dir, math_jsonl, tmp_path):
    extra = ["--use_rollout_logprobs", "true", "--rollout_importance_sampling_mode", "token_mask"]
    with pytest.raises(ConfigError, match="every weight would be 1"):
        parse_train_args(_args(tiny_model_dir, math_jsonl, tmp_path / "o") + extra)


@pytest.mark.slow
def test_a_window_trains_on_the_engine_logps_without_an_old_logps_forward(
    tiny_model_dir, math_jsonl, tmp_path, monkeypatch
):
    from grpokit.pipeline.train import run_train
    from grpokit.trainers.factory import TrainerFactory
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    seen: dict = {"forwards": 0, "gap": [], "old_given": []}
    recompute = WindowProducer._batched_logps

    def counted(self, *args, **kwargs):
        seen["forwards"] += 1
        return recompute(self, *args, **kwargs)

    monkeypatch.setattr(WindowProducer, "_batched_logps", counted)

    class Probe(GRPOTrainer):
        def _prepare_inputs(self, prompts, rollout=None):
            window = super()._prepare_inputs(prompts, rollout)
            batch = window.batch
            mask = batch.completion_mask.bool()
            assert torch.equal(batch.old_logps, torch.nan_to_num(batch.rollout_logps, nan=0.0))
            with torch.no_grad():  # the policy the window was sampled from: the engine's logprobs are its own
                lp, _ = self._get_per_token_logps_and_entropies(self.model, batch.to(self.accelerator.device))
            seen["gap"].append(float((lp.float() - batch.old_logps)[mask].abs().max()))
            return window

        def _compute_loss_and_metrics(self, model, inputs):
            seen["old_given"].append(inputs.old_logps is not None)
            return super()._compute_loss_and_metrics(model, inputs)

    saved = dict(TrainerFactory.TRAINER_MAPPING)
    TrainerFactory.TRAINER_MAPPING["grpo"] = Probe
    try:
        run_train(
            parse_train_args(_args(tiny_model_dir, math_jsonl, tmp_path / "w") + ["--use_rollout_logprobs", "true"])
        )
    finally:
        TrainerFactory.TRAINER_MAPPING.clear()
        TrainerFactory.TRAINER_MAPPING.update(saved)
    assert seen["forwards"] == 0  # the second optimizer step of each window needs no recomputed old logps
    assert seen["old_given"] == [True] * 4  # every micro-step's ratio is against the engine's logprobs
    assert len(seen["gap"]) == 2 and max(seen["gap"]) < 1e-4  # float32: the sampler computes what the trainer does
