"""`grpokit train` end to end on a tiny model: outputs, resume, the rollout window, LoRA, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch
from cli_process import StartedGrpokit, run_grpokit
from support import flags, shorter_reward_plugin

pytestmark = pytest.mark.slow

PLUGIN = shorter_reward_plugin("len_reward") + textwrap.dedent("""
    import threading
    from grpokit.trainers.callbacks import TrainerCallback, callbacks_map

    class ParkAfterStep2(TrainerCallback):
        '''After step 2 (its checkpoint and log row written) say so in a file and wait to be killed; a run
        resumed from checkpoint-2 never ends step 2 and goes on. The wait ends by itself after 10 minutes, so
        that a test that failed before killing leaves nothing running for good.'''
        def on_step_end(self, trainer):
            if trainer.state.global_step == 2:
                (trainer.output_dir / "parked").touch()
                threading.Event().wait(600)

    callbacks_map['park_after_step_2'] = ParkAfterStep2
""")


def _base_args(model_dir: Path, data: Path, out: Path, plugin: Path) -> list[str]:
    return flags(
        {"--model": model_dir, "--dataset": data, "--output_dir": out, "--external_plugins": plugin},
        "--tuner_type full --reward_funcs len_reward accuracy --num_generations 4 --per_device_train_batch_size 8",
        "--max_completion_length 12 --learning_rate 1e-3 --torch_dtype float32 --logging_steps 1 --seed 0",
        "--disable_tqdm true",
    )


@pytest.fixture
def plugin_file(tmp_path) -> Path:
    p = tmp_path / "spine_plugin.py"
    p.write_text(PLUGIN)
    return p


def _cli(args: list[str], timeout: int = 300, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return run_grpokit(["train", *args], env=env, timeout=timeout)  # a forked process (cli_process.py)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]


def test_train_writes_every_output_and_updates_every_parameter(tiny_model_dir, math_jsonl, plugin_file, tmp_path):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    out = tmp_path / "run"
    cfg = parse_train_args(
        _base_args(tiny_model_dir, math_jsonl, out, plugin_file)
        + flags("--max_steps 3 --save_steps 2 --save_total_limit 1 --log_completions true --beta 0.04")
    )
    before = {
        n: p.detach().clone()
        for n, p in __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters()
    }
    trainer = run_train(cfg)
    assert trainer.state.global_step == 3
    # every trainable parameter changed
    after = dict(trainer.accelerator.unwrap_model(trainer.model).named_parameters())
    unchanged = [n for n, p in after.items() if p.requires_grad and torch.equal(p.detach().cpu(), before[n])]
    assert not unchanged, unchanged
    # files
    args = json.loads((out / "args.json").read_text())
    assert args["num_generations"] == 4 and args["reward_funcs"] == ["len_reward", "accuracy"]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in (
        "loss",
        "reward",
        "reward_std",
        "rewards/len_reward/mean",
        "rewards/accuracy/mean",
        "frac_reward_zero_std",
        "kl",
        "clip_ratio/region_mean",
        "completions/mean_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "learning_rate",
        "timing/rollout",
        "timing/reward",
        "timing/train",
    ):
        assert all(key in r for r in rows), key
    comps = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(comps) == 3 * 8  # one window per step, 8 completions each
    assert {"step", "prompt", "completion", "advantage", "len_reward", "accuracy"} <= set(comps[0])
    ckpts = sorted(p.name for p in out.glob("checkpoint-*"))
    assert ckpts == ["checkpoint-3"]  # save_total_limit 1 removed checkpoint-2
    for name in ("model.safetensors", "trainer_state.json", "tokenizer_config.json"):
        assert (out / "checkpoint-3" / name).is_file(), name
    assert any((out / "checkpoint-3" / "state").iterdir())
    assert (out / "final_model" / "model.safetensors").is_file()
    for plot in ("reward.png", "kl.png", "completion_length.png"):
        assert (out / plot).stat().st_size > 1000, plot


def test_killed_run_resumes_without_gaps(tiny_model_dir, math_jsonl, plugin_file, tmp_path):
    out = tmp_path / "resume"
    args = _base_args(tiny_model_dir, math_jsonl, out, plugin_file) + flags(
        "--max_steps 6 --save_steps 2 --callbacks park_after_step_2"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = StartedGrpokit(["train", *args], env=env)  # a forked process of its own group (cli_process.py)
    try:
        deadline = time.monotonic() + 240  # a guard against a run that never gets there
        while not (out / "parked").exists():  # the run waits there, after step 2, until it is killed
            assert proc.poll() is None, "run ended before step 2 ended"
            assert time.monotonic() < deadline, "run never ended step 2"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert [r["step"] for r in _rows(out)] == [1, 2]  # killed mid-run: steps 3 to 6 never ran
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    res = _cli(args + ["--resume_from_checkpoint", "latest"])
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [r["step"] for r in _rows(out) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    # a fresh (not resumed) run into the same folder is refused before any model loads: rotation would delete
    # its checkpoints in favour of the earlier run's and 'latest' would resume the earlier run
    fresh = _base_args(tiny_model_dir, math_jsonl, out, plugin_file) + flags(
        "--max_steps 2 --save_steps 9 --save_total_limit 1"
    )
    res = _cli(fresh)
    assert res.returncode != 0
    assert "checkpoints of an earlier run" in res.stderr and "--overwrite_output_dir true" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    # told to, it replaces them: only its own checkpoint and log rows remain
    res = _cli(fresh + ["--overwrite_output_dir", "true"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert [r["step"] for r in _rows(out)] == [1, 2]


def test_window_reuses_one_rollout_for_steps_per_generation(tiny_model_dir, math_jsonl, plugin_file, tmp_path):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train
    from grpokit.trainers.factory import TrainerFactory
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    seen: dict = {"infer_calls": 0, "windows": [], "micro": [], "old_given": [], "old_error": []}

    def rows(batch) -> list[tuple[list[int], list[float]]]:
        """Each row's real tokens (padding dropped) and its completion mask up to its last trained token."""
        out = []
        for ids, att, cmask in zip(batch.input_ids, batch.attention_mask, batch.completion_mask, strict=True):
            mask = cmask.tolist()
            while mask and mask[-1] == 0:
                mask.pop()
            out.append((ids[att.bool()].tolist(), mask))
        return out

    class Probe(GRPOTrainer):
        def _generate_completions(self, requests):
            seen["infer_calls"] += 1
            return super()._generate_completions(requests)

        def _prepare_inputs(self, prompts, rollout=None):
            window = super()._prepare_inputs(prompts, rollout)
            batch = window.batch
            seen["windows"].append(rows(batch))
            with torch.no_grad():  # the policy the window starts with, over every row
                lp, _ = self._get_per_token_logps_and_entropies(self.model, batch.to(self.accelerator.device))
            old, mask = batch.old_logps, batch.completion_mask.bool()
            assert old.isnan().all(1).tolist() == [True] * 4 + [False] * 12  # the first step's rows: no forward
            seen["old_error"].append(float((lp.float() - old)[4:][mask[4:]].abs().max()))
            return window

        def _compute_loss_and_metrics(self, model, inputs):
            seen["micro"].append(rows(inputs))
            seen["old_given"].append(inputs.old_logps is not None)
            return super()._compute_loss_and_metrics(model, inputs)

    saved = dict(TrainerFactory.TRAINER_MAPPING)
    TrainerFactory.TRAINER_MAPPING["grpo"] = Probe
    try:
        cfg = parse_train_args(
            _base_args(tiny_model_dir, math_jsonl, tmp_path / "w", plugin_file)
            + flags("--per_device_train_batch_size 4 --steps_per_generation 4 --max_steps 8 --save_steps 100 --beta 0")
        )
        run_train(cfg)
    finally:
        TrainerFactory.TRAINER_MAPPING.clear()
        TrainerFactory.TRAINER_MAPPING.update(saved)
    assert seen["infer_calls"] == 2  # 8 micro-steps, one rollout per 4
    assert len(seen["windows"]) == 2 and len(seen["micro"]) == 8
    # each window of 16 rows is trained as its 4 consecutive slices of 4, in order: every row once, none from
    # another window, whatever padding each micro-batch was trimmed to
    for w, window in enumerate(seen["windows"]):
        assert len(window) == 16
        micro = seen["micro"][4 * w : 4 * w + 4]
        assert [len(m) for m in micro] == [4, 4, 4, 4]
        assert [row for m in micro for row in m] == window
    assert seen["windows"][0] != seen["windows"][1]  # the second window is a new rollout
    # the policy drifts inside the window: old logps are the window-start policy's, computed before the first
    # update for the rows of micro-steps 2-4; micro-step 1 trains with that policy itself and gets none
    assert seen["old_given"] == [False, True, True, True] * 2
    assert max(seen["old_error"]) < 1e-5


def test_lora_holds_one_copy_and_ref_is_base(tiny_model_dir, math_jsonl, plugin_file, tmp_path):
    from transformers import AutoModelForCausalLM

    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train
    from grpokit.trainers.factory import TrainerFactory
    from grpokit.trainers.grpo_trainer import GRPOTrainer

    checks: dict = {}

    class Probe(GRPOTrainer):
        def _prepare_inputs(self, prompts, rollout=None):
            window = super()._prepare_inputs(prompts, rollout)
            batch = window.batch
            base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
            with torch.no_grad():
                checks["base_logps"], _ = self._get_per_token_logps_and_entropies(base, batch)
            checks["ref_logps"] = batch.ref_logps
            checks["mask"] = batch.completion_mask
            return window

    saved = dict(TrainerFactory.TRAINER_MAPPING)
    TrainerFactory.TRAINER_MAPPING["grpo"] = Probe
    try:
        cfg = parse_train_args(
            _base_args(tiny_model_dir, math_jsonl, tmp_path / "lora", plugin_file)
            + flags("--tuner_type lora --lora_rank 4 --max_steps 2 --beta 0.1 --save_steps 100")
        )
        trainer = run_train(cfg)
    finally:
        TrainerFactory.TRAINER_MAPPING.clear()
        TrainerFactory.TRAINER_MAPPING.update(saved)
    assert trainer.ref_model is None  # no second copy of the base weights
    model = trainer.accelerator.unwrap_model(trainer.model)
    base_weights = [n for n, _ in model.named_parameters() if "lora_" not in n]
    n_layers_weights = len(list(AutoModelForCausalLM.from_pretrained(tiny_model_dir).parameters()))
    assert len(base_weights) == n_layers_weights  # exactly one copy of every base tensor
    mask = checks["mask"].bool()
    assert torch.allclose(checks["ref_logps"][mask], checks["base_logps"][mask], atol=1e-5)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--reward_funcs", "nope"], "registered:"),
        (["--dataset", "/no/such/file.jsonl"], "/no/such/file.jsonl"),
        (["--num_generations", "3"], "num_generations"),
        (["--model", "/no/such/model"], "/no/such/model"),
        (["--no_such_flag", "1"], "--no_such_flag"),
    ],
)
def test_bad_input_is_one_line(tiny_model_dir, math_jsonl, tmp_path, extra, needle):
    args = flags(
        {"--model": tiny_model_dir, "--dataset": math_jsonl, "--output_dir": tmp_path / "bad"},
        "--tuner_type full --num_generations 4 --per_device_train_batch_size 8 --max_steps 1",
    )
    for flag, value in zip(extra[::2], extra[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    res = _cli(args, timeout=120)
    assert res.returncode != 0
    err = res.stderr.strip().splitlines()
    assert len(err) == 1, res.stderr
    assert "Traceback" not in res.stderr and needle in err[0]


def test_dataset_without_prompt_column(tiny_model_dir, tmp_path):
    data = tmp_path / "noprompt.jsonl"
    data.write_text(json.dumps({"text": "hi", "solution": "1"}) + "\n")
    res = _cli(
        flags(
            {"--model": tiny_model_dir, "--dataset": data, "--output_dir": tmp_path / "o"},
            "--tuner_type full --num_generations 2 --per_device_train_batch_size 2 --max_steps 1",
        ),
        timeout=120,
    )
    assert res.returncode != 0
    assert len(res.stderr.strip().splitlines()) == 1 and "messages" in res.stderr
