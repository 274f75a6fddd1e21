"""Training with the sandboxed code_exec reward: failing programs score 0, are counted, and training goes on."""

from __future__ import annotations

import json

import pytest
from support import flags, write_jsonl

pytestmark = pytest.mark.slow


def test_training_continues_and_logs_sandbox_failures(tiny_model_dir, tmp_path):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    rows = [
        {"query": f"Write a program that prints {k} + 1.", "test_cases": [{"input": "", "output": str(k + 1)}]}
        for k in range(4)
    ]
    data = write_jsonl(tmp_path / "code.jsonl", rows)
    out = tmp_path / "run"
    # a random model writes no valid program: every sample fails in the sandbox (syntax errors and the like)
    run_train(
        parse_train_args(
            flags(
                {"--model": tiny_model_dir, "--dataset": data, "--output_dir": out},
                "--tuner_type full --reward_funcs code_exec format --num_generations 2",
                "--per_device_train_batch_size 4 --max_completion_length 8 --max_steps 2 --code_exec_timeout 2",
                "--code_exec_workers 2 --disable_tqdm true --beta 0",
            )
        )
    )
    logs = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs] == [1, 2]
    for r in logs:
        assert r["rewards/code_exec/mean"] == 0.0
        failures = sum(v for k, v in r.items() if k.startswith("rewards/code_exec/sandbox_"))
        assert failures == 4  # all four programs of the window failed and were counted, by kind


def test_rows_the_grader_cannot_run_are_refused_before_training(tiny_model_dir, tmp_path):
    from grpokit.config.parse import parse_train_args
    from grpokit.errors import ConfigError
    from grpokit.pipeline.train import run_train

    rows = [
        {"query": "Write f.", "test_cases": "assert f(1) == 2"},
        {"query": "Write g.", "test_cases": "import subprocess\nassert g(1) == subprocess.call(['true'])"},
    ]
    data = write_jsonl(tmp_path / "code.jsonl", rows)
    with pytest.raises(ConfigError, match=r"code_exec: dataset row 1: test_cases\[1\]: import of 'subprocess'"):
        run_train(
            parse_train_args(
                flags(
                    {"--model": tiny_model_dir, "--dataset": data, "--output_dir": tmp_path / "run"},
                    "--tuner_type full --reward_funcs code_exec --num_generations 2",
                    "--per_device_train_batch_size 2 --max_completion_length 8 --max_steps 1 --disable_tqdm true",
                    "--beta 0",
                )
            )
        )
    assert not (tmp_path / "run" / "logging.jsonl").exists()
