"""ms-swift's option names in a real run on the tiny model: the implemented ones act, a warned one trains as if
absent (its one warning line at start-up), and worker-read prompts are the same rows as in-process ones."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from support import flags

pytestmark = pytest.mark.slow


def _args(model_dir: Path, data: Path, out: Path) -> list[str]:
    return flags(
        {"--model": model_dir, "--dataset": data, "--output_dir": out},
        "--tuner_type full --reward_funcs accuracy --num_generations 4 --per_device_train_batch_size 8",
        "--max_completion_length 8 --learning_rate 1e-3 --torch_dtype float32 --seed 0 --disable_tqdm true",
        "--max_steps 3",
    )


def test_swift_training_options_act(tiny_model_dir, math_jsonl, tmp_path, monkeypatch, caplog):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train
    from grpokit.trainers import grpo_trainer

    eval_calls = []
    real_evaluate = grpo_trainer.evaluate_policy

    def spy(*args, **kwargs):
        eval_calls.append(args[5].batch_size)  # the EvalSettings
        state = kwargs["trainer_state"]  # rewards read trainer_state.global_step during evaluation too
        assert set(state) == {"global_step", "max_steps"} and state["max_steps"] == 3
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(grpo_trainer, "evaluate_policy", spy)
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1"}], "solution": "2"}) + "\n")
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        cfg = parse_train_args(
            _args(tiny_model_dir, math_jsonl, out)
            + flags(
                {"--lr_scheduler_kwargs": '{"num_cycles": 0.25}'},
                {"--gradient_checkpointing_kwargs": '{"use_reentrant": false}'},
                {"--target_regex": r".*\.(q_proj|v_proj)", "--val_dataset": val},
                "--logging_steps 2 --save_strategy no --save_steps 1 --warmup_steps 2 --optim adamw_torch",
                "--adam_epsilon 1e-6 --lr_scheduler_type cosine --attn_impl eager --gradient_checkpointing true",
                "--tuner_type lora --use_rslora true --eval_strategy steps --eval_steps 3",
                "--per_device_eval_batch_size 5 --eval_on_start true --max_new_tokens 6 --use_liger_kernel true",
                "--rlhf_type grpo --dataloader_num_workers 1",
            )
        )
    warned = [r.getMessage() for r in caplog.records if "no effect in grpokit" in r.getMessage()]
    assert warned == [warned[0]] and warned[0].startswith("--use_liger_kernel true: no effect in grpokit")
    assert cfg.rollout.max_completion_length == 6 and cfg.training.optimizer == "adamw"
    trainer = run_train(cfg)

    rows = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]  # first step, every 2nd, the last
    assert [r["step"] for r in rows if any(k.startswith("eval/") for k in r)] == [0, 3]
    # warm-up over 2 steps: 1e-3 × 1/2 after step 1; then cosine with num_cycles 0.25 (a quarter wave)
    assert train[0]["learning_rate"] == pytest.approx(5e-4)
    # at the end, progress 1: 0.5·(1 + cos(2π·0.25·1)) = 0.5 of the peak (with cosine's default 0.5 cycles: 0)
    assert train[2]["learning_rate"] == pytest.approx(5e-4)
    assert not (out / "checkpoint-1").exists() and not (out / "checkpoint-2").exists()
    assert eval_calls == [5, 5]  # before step 1 (eval_on_start) and at step 3
    policy = trainer.policy
    assert policy.config._attn_implementation == "eager"
    assert policy.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == pytest.approx(
        cfg.model.lora_alpha / cfg.model.lora_rank**0.5
    )  # rsLoRA: alpha / sqrt(r)
    assert not hasattr(policy.base_model.model.model.layers[0].self_attn.k_proj, "lora_A")  # outside target_regex
    assert trainer.optimizer.optimizer.defaults["eps"] == 1e-6
    assert policy.is_gradient_checkpointing
    assert trainer._producer.prompts.num_workers == 1  # the rows came through a worker (stopped with the loop)


def test_prompt_rows_read_by_workers_equal_in_process_rows(tmp_path):
    import os

    from grpokit.trainers.prompts import PromptStream

    rows = [{"messages": [{"role": "user", "content": str(i)}], "i": i} for i in range(7)]
    plain = PromptStream(rows, 3, seed=1, shuffle=True)
    ahead = PromptStream(
        _PidRows(rows), 3, seed=1, shuffle=True, num_workers=2, prefetch_factor=1, multiprocessing_context="fork"
    )
    for _ in range(5):  # past two epochs of 7 rows
        a, b = plain.next(), ahead.next()
        assert [{k: v for k, v in r.items() if k != "pid"} for r in b] == a
        assert {r["pid"] for r in b} != {os.getpid()}  # read by a worker
    assert ahead._loader.multiprocessing_context.get_start_method() == "fork"
    plain.position = ahead.position = 3  # a resume sets the position back
    assert [r["i"] for r in ahead.next()] == [r["i"] for r in plain.next()]


class _PidRows(list):
    """A row list whose reads record the reading process."""

    def __getitem__(self, i):
        import os

        return {**super().__getitem__(i), "pid": os.getpid()}
