"""Token in, token out through vLLM colocate (text): a chat template that drops earlier <think> blocks, a 3-turn
scheduler whose replies open with one, one training step (vLLM's start-up is most of the time). vLLM samples
every later turn from the trajectory's own ids (pinned on the engine's template, engines/vllm_mm.py
``vllm_inputs``), so the trainer counts 0 violations; the start-up line says the template is not
prefix-preserving."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from fake_schedulers import ThinkThenObserve
from support import QUIET, VLLM_COLOCATE, flags

from grpokit.rollout.multi_turn import multi_turns
from grpokit.testing import THINK_DROPPING_TEMPLATE

pytestmark = pytest.mark.vllm


def test_vllm_colocate_samples_later_turns_from_the_trajectory_ids(tiny128, tmp_path, caplog):
    from transformers import AutoTokenizer

    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    torch.set_num_threads(1)
    model = tmp_path / "model"
    shutil.copytree(tiny128, model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = THINK_DROPPING_TEMPLATE
    tok.save_pretrained(model)
    caplog.set_level(logging.WARNING, logger="grpokit")
    multi_turns["think_then_observe_vllm"] = ThinkThenObserve  # the conftest restores the registry
    out = tmp_path / "out"
    trainer = run_train(
        parse_train_args(
            flags(
                {"--model": model, "--output_dir": out},
                "--tuner_type full --dataset builtin:arithmetic --reward_funcs test_length --max_steps 1",
                "--num_generations 2 --per_device_train_batch_size 2 --max_completion_length 8",
                "--multi_turn_scheduler think_then_observe_vllm --max_turns 3 --learning_rate 1e-3 --beta 0",
                "--torch_dtype float32",
                VLLM_COLOCATE,
                QUIET,
            )
        )
    )
    try:
        assert trainer.state.global_step == 1
        assert any("not prefix-preserving" in r.getMessage() for r in caplog.records)
        steps = [r for r in map(json.loads, (out / "logging.jsonl").read_text().splitlines()) if "loss" in r]
        assert len(steps) == 1
        assert all(r["multi_turn/tito_violations"] == 0 and r["multi_turn/tito_unchecked"] == 0 for r in steps)
    finally:
        trainer.engine.close()
