"""The demo's recipe (grpokit/config/demo.yaml, as `grpokit train` with no arguments runs it) on the tiny model:
it evaluates the held-out split before and after training, ends with that score before → after, and its viewer
page holds the completions it logged."""

from __future__ import annotations

import json
import os
import re

import pytest
from cli_process import run_grpokit

from grpokit.config.parse import DEMO_YAML

pytestmark = pytest.mark.slow


def test_the_demo_recipe_ends_with_its_held_out_score_before_and_after(tiny_model_dir, tmp_path):
    out = tmp_path / "demo"
    res = run_grpokit(
        [
            "train",
            "--config",
            str(DEMO_YAML),
            "--model",
            str(tiny_model_dir),
            "--output_dir",
            str(out),
            *"--max_steps 2 --torch_dtype float32 --plots false --save_final_model false".split(),
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    last = res.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"held-out accuracy \(greedy\): \d\.\d{3} at step 0 → \d\.\d{3} at step 2", last), last
    evals = [r for r in map(json.loads, (out / "logging.jsonl").read_text().splitlines()) if "loss" not in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert last.endswith(
        f"{evals[0]['eval/accuracy/greedy']:.3f} at step 0 → {evals[1]['eval/accuracy/greedy']:.3f} at step 2"
    )
    completions = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert completions, "the demo logs its completions"
    page = (out / "report.html").read_text()
    assert json.dumps(completions[0]["prompt"])[1:-1] in page or completions[0]["prompt"] in page
