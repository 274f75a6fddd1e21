"""examples/plugin/plugin.py drives a real run: its rewards, scheduler, optimizer, callback and trainer are used."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from cli_process import run_grpokit
from support import flags

from grpokit.rewards import orms, prms, rm_plugins
from grpokit.rollout.env import envs
from grpokit.rollout.multi_turn import multi_turns
from grpokit.trainers.callbacks import callbacks_map
from grpokit.trainers.factory import TrainerFactory
from grpokit.trainers.optimizers import optimizers_map

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plugin" / "plugin.py"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"
REGISTRIES = (orms, prms, rm_plugins, multi_turns, envs, callbacks_map, optimizers_map, TrainerFactory.TRAINER_MAPPING)


# A random tiny model never solves countdown: both example rewards are 0 everywhere, so every advantage would be
# 0 and nothing would train. A second plugin file adds a reward that varies (and shows files load in order).
SIGNAL_PLUGIN = """
from grpokit.rewards import orms

def shorter_is_better(completions, **kwargs):
    return [1.0 / (1 + len(c)) for c in completions]

orms["shorter_is_better"] = shorter_is_better
"""


@pytest.fixture
def restore_plugin_state():
    """The plugin writes into process-wide registries and TRAINER_MAPPING: put them back afterwards."""
    saved = [dict(r) for r in REGISTRIES]
    path = list(sys.path)
    yield
    for registry, before in zip(REGISTRIES, saved, strict=True):
        dict.clear(registry)
        dict.update(registry, before)
    sys.path[:] = path
    for name in ("plugin", "countdown_check", "signal_plugin"):
        sys.modules.pop(name, None)


def test_example_plugin_trains_with_its_own_components(tiny_model_dir, tmp_path, restore_plugin_state):
    from transformers import AutoModelForCausalLM

    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    lr = 1e-3
    out = tmp_path / "run"
    signal = tmp_path / "signal_plugin.py"
    signal.write_text(SIGNAL_PLUGIN)
    cfg = parse_train_args(
        flags(
            "--model",
            str(tiny_model_dir),
            "--tuner_type full --dataset builtin:countdown#16",
            "--output_dir",
            str(out),
            "--external_plugins",
            str(EXAMPLE),
            str(signal),
            "--reward_funcs countdown countdown_judge shorter_is_better",
            "--reward_weights 1.0 0.2 1.0 --multi_turn_scheduler countdown_retry",
            "--max_turns 2 --optimizer lion",
            "--learning_rate",
            str(lr),
            "--lr_scheduler_type constant --callbacks reward_summary --num_generations 4",
            "--per_device_train_batch_size 8 --max_completion_length 12 --max_steps 2",
            "--beta 0 --torch_dtype float32 --seed 0 --log_completions true --plots false",
            "--save_final_model false --disable_tqdm true",
        )
    )
    before = {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters()}
    trainer = run_train(cfg)

    # the trainer subclass, through TRAINER_MAPPING['grpo'] = "plugin.CountdownTrainer"
    assert TrainerFactory.TRAINER_MAPPING["grpo"] == "plugin.CountdownTrainer"
    assert type(trainer).__module__ == "plugin" and type(trainer).__name__ == "CountdownTrainer"
    assert trainer.loss_calls == 2  # one micro-step per window (8 completions, batch 8), two windows

    # the optimizer (accelerate wraps it): two real steps, and Lion's signature — every element moved by a whole
    # number of learning rates: 0 (no gradient, or the two signs cancelled), lr (one step) or 2·lr
    optimizer = trainer.optimizer.optimizer
    assert type(optimizer).__name__ == "Lion" and optimizer.steps_taken == 2
    after = dict(trainer.accelerator.unwrap_model(trainer.model).named_parameters())
    moved = torch.cat([(after[n].detach().cpu() - before[n]).abs().flatten() for n in before])  # [P]
    nearest = (moved / lr).round().clamp(max=2)
    assert torch.allclose(moved, nearest * lr, atol=1e-6), float((moved - nearest * lr).abs().max())
    assert (nearest == 2).float().mean() > 0.1  # most weights got the same sign twice

    # the rewards, their last_metrics and the trainer's own metrics, logged every step
    rows = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 <= r["rewards/countdown/mean"] <= 1.0 and 0.0 <= r["rewards/countdown_judge/mean"] <= 1.0
        assert 0.0 <= r["rewards/countdown/has_answer"] <= 1.0
        assert r["rewards/countdown_judge/max_in_flight"] == 8.0  # all 8 completions of a window judged at once
        assert 0.0 <= r["plugin/positive_adv_token_frac"] <= 1.0 and r["plugin/abs_adv_token_mean"] >= 0.0

    # the scheduler: a random tiny model never solves countdown, so every trajectory got feedback and a 2nd turn
    comps = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(comps) == 16
    for c in comps:
        assert [m["role"] for m in c["messages"]] == ["user", "assistant", "user", "assistant"]
        assert c["messages"][2]["content"].startswith(("Not yet:", "Your reply was cut off"))
        assert c["countdown"] in (0.0, 1.0)

    # the callback
    summary = json.loads((out / "reward_summary.json").read_text())
    assert [p["step"] for p in summary["curve"]] == [1, 2]
    assert summary["best_reward"] == max(r["reward"] for r in rows)


def _docs_block(registered_name: str) -> str:
    """The python block of docs/plugins.md that registers this name."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    return next(b for b in blocks if f'.register("{registered_name}")' in b)


def test_docs_plugin_loss_and_advantage_estimator_train_from_the_cli(tiny_model_dir, math_jsonl, tmp_path):
    """`grpokit train --external_plugins my_algos.py --loss_type vanilla_pg --advantage_estimator above_mean`,
    with the two examples of docs/plugins.md as the plugin (plus a reward that varies on a random model)."""
    plugin = tmp_path / "my_algos.py"
    plugin.write_text(_docs_block("vanilla_pg") + "\n" + _docs_block("above_mean") + SIGNAL_PLUGIN)
    out = tmp_path / "run"
    args = flags(
        {"--model": tiny_model_dir, "--dataset": math_jsonl, "--output_dir": out, "--external_plugins": plugin},
        "--tuner_type full --loss_type vanilla_pg --advantage_estimator above_mean",
        "--reward_funcs shorter_is_better --num_generations 4 --per_device_train_batch_size 8",
        "--max_completion_length 8 --max_steps 2 --learning_rate 1e-3 --beta 0 --torch_dtype float32 --seed 0",
        "--plots false --save_final_model false",
    )
    res = run_grpokit(["train", *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240)  # cli_process.py
    assert res.returncode == 0, res.stderr[-3000:]
    saved = json.loads((out / "args.json").read_text())
    assert (saved["loss_type"], saved["advantage_estimator"]) == ("vanilla_pg", "above_mean")
    rows = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss"]) and "is_ratio/mean" in r
        # vanilla_pg reports no clipping; the PPO-clip default logs clip_ratio/low_mean, high_mean, region_mean
        assert not [k for k in r if k.startswith("clip_ratio/")], r
        # above_mean clamps at 0: no negative advantage, though the rewards differ within groups
        assert r["advantages/min"] >= 0.0 and r["advantages/max"] > 0.0, r
