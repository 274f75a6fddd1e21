"""Token in, token out on the tiny model (transformers engine, float32): a chat template that drops earlier
<think> blocks, a 3-turn scheduler whose first reply opens with a <think> block, and two training steps. The
start-up line says the template is not prefix-preserving; every later turn is sampled from the trajectory's own
ids (not from the re-render, which would have lost the block), and logging.jsonl holds 0 violations every step."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from fake_schedulers import PREFILL, ThinkThenObserve
from support import flags, write_jsonl

from grpokit.rollout.multi_turn import multi_turns
from grpokit.rollout.tito import RECORD_KEY
from grpokit.testing import THINK_DROPPING_TEMPLATE
from grpokit.trainers.factory import TrainerFactory
from grpokit.trainers.grpo_trainer import GRPOTrainer

pytestmark = pytest.mark.slow


class Recording(GRPOTrainer):
    windows: list = []

    def _prepare_inputs(self, prompts, rollout=None):
        window = super()._prepare_inputs(prompts, rollout)
        Recording.windows.append((window.outputs, window.batch))
        return window


@pytest.fixture(scope="module")
def dropping_model(tiny_model_dir, tmp_path_factory):
    """The session's tiny model with the think-dropping chat template (a copy: the session's stays ChatML)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tito") / "model"
    shutil.copytree(tiny_model_dir, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = THINK_DROPPING_TEMPLATE
    tok.save_pretrained(out)
    return out


def test_three_turns_under_a_think_dropping_template_train_on_sampled_ids(dropping_model, tmp_path, caplog):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    caplog.set_level(logging.WARNING, logger="grpokit")
    multi_turns["think_then_observe"] = ThinkThenObserve  # the conftest restores the registry
    saved, Recording.windows = TrainerFactory.TRAINER_MAPPING["grpo"], []
    TrainerFactory.TRAINER_MAPPING["grpo"] = Recording
    rows = [{"messages": [{"role": "user", "content": f"What is {a} + 1?"}], "solution": str(a + 1)} for a in (1, 2)]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    out = tmp_path / "out"
    try:
        trainer = run_train(
            parse_train_args(
                flags(
                    {"--model": dropping_model, "--dataset": data, "--output_dir": out},
                    "--tuner_type full --max_steps 2 --num_generations 2 --per_device_train_batch_size 4",
                    "--max_completion_length 8 --multi_turn_scheduler think_then_observe --max_turns 3",
                    "--reward_funcs format --learning_rate 1e-3 --beta 0 --torch_dtype float32 --seed 0",
                    "--disable_tqdm true --plots false --save_final_model false",
                )
            )
        )
    finally:
        TrainerFactory.TRAINER_MAPPING["grpo"] = saved
    assert trainer.state.global_step == 2
    said = [r.getMessage() for r in caplog.records if "not prefix-preserving" in r.getMessage()]
    assert len(said) == 1 and "never from a re-render" in said[0]
    logs = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    steps = [r for r in logs if "loss" in r]
    assert len(steps) == 2
    assert all(r["multi_turn/tito_violations"] == 0 and r["multi_turn/tito_unchecked"] == 0 for r in steps)
    template = trainer.template
    for outputs, batch in Recording.windows:
        c = batch.completion_mask.shape[1]
        p_width = batch.input_ids.shape[1] - c
        for i, o in enumerate(outputs):
            assert o.rollout_infos["num_turns"] == 3 and len(o.rollout_infos[RECORD_KEY]) == 3
            assert o.messages[1]["content"].startswith(PREFILL)
            p = int(batch.attention_mask[i, :p_width].sum())
            full = batch.input_ids[i, p_width - p :].tolist()
            # the sampled ids train as sampled, mask 1 on them
            first = o.response_token_ids[0]
            assert full[p : p + len(first)] == first and batch.completion_mask[i, : len(first)].sum() == sum(
                o.response_loss_mask[0]
            )
            # turn 3 was sampled after turn 1's <think> block: a re-render of its messages has lost it
            turn3_prompt = o.rollout_infos[RECORD_KEY][2][0]
            assert template.encode_prompt(o.messages[:5]) != full[:turn3_prompt]
            assert template.tokenize(PREFILL) == full[p - len(template.tokenize(PREFILL)) : p]
