"""A run whose stderr is a file (nohup, a pipe, a CI log) reports its progress in plain lines."""

from __future__ import annotations

import os
import re

import pytest
from cli_process import run_grpokit

pytestmark = pytest.mark.slow


def test_a_run_without_a_terminal_writes_progress_lines(tiny_model_dir, math_jsonl, tmp_path):
    args = [
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(math_jsonl),
        "--output_dir",
        str(tmp_path / "out"),
        "--num_generations",
        "4",
        "--per_device_train_batch_size",
        "8",
        "--max_completion_length",
        "6",
        "--max_steps",
        "2",
        "--beta",
        "0",
        "--torch_dtype",
        "float32",
        "--plots",
        "false",
        "--save_final_model",
        "false",
    ]
    # a forked process (cli_process.py) whose stderr is a file, read back after it ended
    res = run_grpokit(["train", *args], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240)
    stderr = res.stderr
    assert res.returncode == 0, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("train: step")]
    # the first and the last step always get a line (and any step 30 s after the previous line)
    assert [int(re.match(r"train: step (\d+)/2 ", line).group(1)) for line in lines] == [1, 2], stderr
    assert re.fullmatch(
        r"train: step 2/2 \(100%\) \| reward \d\.\d{3} \| loss -?\d\.\d{4} \| \d+s elapsed, "
        r"\d+\.\d\d (s/step|steps/s), ETA 0s",
        lines[-1],
    ), lines[-1]
    assert "\r" not in stderr  # no bar drawn into the file
    assert res.stdout.index("batch plan:") < res.stdout.index("done: 2 optimizer steps")
