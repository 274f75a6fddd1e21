"""`grpokit infer`: scores of a model and of a trained LoRA adapter folder, as the README shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _infer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpokit", "infer", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_infer_scores_a_model_and_writes_completions(tiny_model_dir, math_jsonl, tmp_path):
    out = tmp_path / "scores.jsonl"
    res = _infer("--model", str(tiny_model_dir), "--dataset", str(math_jsonl), "--limit", "6",
                 "--max_new_tokens", "6", "--output", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "6 prompts, greedy" in res.stdout and "accuracy" in res.stdout
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["accuracy"] == 0.0 and len(lines) == 7  # a random model; one summary line + 6 rows
    assert {"prompt", "completion", "accuracy"} <= set(lines[1])


def test_infer_greedy_completions_are_the_same_with_hf_generate(tiny_model_dir, math_jsonl, tmp_path):
    """--fast_decode reaches `grpokit infer`; both samplers give the same greedy text (token-level equivalence on
    models with varied output is tested in tests/unit/test_fast_decode.py)."""
    rows = {}
    for flag in ("true", "false"):
        out = tmp_path / f"fast_{flag}.jsonl"
        res = _infer("--model", str(tiny_model_dir), "--dataset", str(math_jsonl), "--limit", "4",
                     "--max_new_tokens", "8", "--output", str(out), "--fast_decode", flag)
        assert res.returncode == 0, res.stderr[-2000:]
        rows[flag] = [json.loads(x) for x in out.read_text().splitlines()][1:]
    assert [r["completion"] for r in rows["true"]] == [r["completion"] for r in rows["false"]]


def test_infer_loads_a_lora_adapter_folder(tiny_model_dir, math_jsonl, tmp_path):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    run = tmp_path / "lora"
    run_train(parse_train_args(["--model", str(tiny_model_dir), "--dataset", str(math_jsonl), "--tuner_type",
                                "lora", "--num_generations", "2", "--per_device_train_batch_size", "4",
                                "--max_completion_length", "4", "--max_steps", "1", "--output_dir", str(run),
                                "--beta", "0", "--disable_tqdm", "true"]))
    assert (run / "final_model" / "adapter_config.json").is_file()
    res = _infer("--model", str(run / "final_model"), "--dataset", str(math_jsonl), "--limit", "2",
                 "--max_new_tokens", "4")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "2 prompts" in res.stdout


def test_infer_missing_model_is_one_line(tmp_path):
    res = _infer("--model", str(tmp_path / "nope"))
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1 and "nope" in res.stderr
