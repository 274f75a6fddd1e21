"""The trainer's logps are taken over the sampler's kept set (issue 32): with top-p / top-k sampling on the tiny
model (transformers engine, float32) the rollout IS weights are 1 and the engine's logprobs equal the trainer's,
on both decoders (grpokit's fast decode loop and HF generate), on- and off-policy windows."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def _train(model_dir, data, out, extra):
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    args = [
        "--model",
        str(model_dir),
        "--tuner_type",
        "full",  # written for full fine-tuning (the default is lora)
        "--dataset",
        str(data),
        "--output_dir",
        str(out),
        "--reward_funcs",
        "format",
        "--num_generations",
        "4",
        "--per_device_train_batch_size",
        "4",
        "--max_completion_length",
        "8",
        "--max_steps",
        "2",
        "--learning_rate",
        "1e-3",
        "--torch_dtype",
        "float32",
        "--disable_tqdm",
        "true",
        "--plots",
        "false",
        "--save_final_model",
        "false",
        "--seed",
        "1",
        "--rollout_importance_sampling_mode",
        "token_truncate",
        *extra,
    ]
    trainer = run_train(parse_train_args(args))
    return trainer, [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]


RUNS = {
    # steps_per_generation 2 > 1 accumulation step: old logps come from the window's own forward
    "fast_top_p_off_policy": ["--top_p", "0.8", "--steps_per_generation", "2"],
    "fast_top_k": ["--top_k", "20", "--temperature", "0.7"],
    "hf_generate_top_p_top_k": ["--top_p", "0.8", "--top_k", "20", "--fast_decode", "false"],
}


@pytest.mark.parametrize("name", list(RUNS))
def test_kept_set_logps_agree_with_the_sampler(tiny_model_dir, math_jsonl, tmp_path, name):
    trainer, rows = _train(tiny_model_dir, math_jsonl, tmp_path / name, RUNS[name])
    assert trainer.engine.fast_decode == ("--fast_decode" not in RUNS[name])
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout_correction/is_weight_mean"] == pytest.approx(1.0, abs=2e-3)
        assert row["mismatch/max_abs"] <= 1e-5
        assert row["mismatch/mean_abs"] <= row["mismatch/max_abs"]
        assert row["mismatch/ratio_mean"] == pytest.approx(1.0, abs=1e-5)


def test_full_vocabulary_logps_show_the_truncation(tiny_model_dir, math_jsonl, tmp_path):
    # --logps_support full (the old behaviour): every trainer logp is below the engine's by −log p(K) > 0
    _, rows = _train(tiny_model_dir, math_jsonl, tmp_path / "full", ["--top_p", "0.8", "--logps_support", "full"])
    for row in rows:
        assert row["rollout_correction/is_weight_mean"] < 0.95
        assert row["mismatch/max_abs"] > 0.05 and row["mismatch/ratio_mean"] < 0.95


def test_vision_language_logprobs_follow_the_same_rule(tmp_path):
    """mm_generate reports the text paths' logprob (log-softmax of the processed scores: special tokens
    suppressed, temperature, top-k, top-p) and the trainer rebuilds the same kept set, blocked tokens included."""
    from PIL import Image

    from grpokit.testing_vlm import build_tiny_vlm

    model_dir = build_tiny_vlm(tmp_path / "vlm", "qwen2_vl")
    rows = []
    for i, colour in enumerate([(220, 20, 30), (20, 200, 40)]):
        path = tmp_path / f"img{i}.png"
        Image.new("RGB", (16, 16), colour).save(path)
        rows.append(
            {
                "messages": [{"role": "user", "content": "<image>What colour is this image?"}],
                "images": [str(path)],
                "solution": "red",
            }
        )
    data = tmp_path / "colours.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer, logged = _train(
        model_dir,
        data,
        tmp_path / "out",
        [
            "--top_p",
            "0.8",
            "--top_k",
            "20",
            "--temperature",
            "0.7",
            "--max_steps",
            "1",
            "--reward_funcs",
            "external_r1v_acc",
            "--num_generations",
            "2",
            "--per_device_train_batch_size",
            "4",
            "--max_completion_length",
            "6",
        ],
    )
    support = trainer._producer.support
    assert support["top_k"] == 20 and support["top_p"] == 0.8 and support["blocked"]  # special tokens blocked
    row = logged[0]
    assert row["rollout_correction/is_weight_mean"] == pytest.approx(1.0, abs=2e-3)
    assert row["mismatch/max_abs"] <= 1e-5
