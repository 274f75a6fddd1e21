"""`--torch_dtype auto` on a CPU: bfloat16 where the CPU has bf16 instructions, float32 elsewhere, and
GRPOKIT_CPU_BF16=0|1 to choose either on any CPU (CI runs tests/unit a second time with the other choice).

The last test trains one step with `auto`, so that both paths (bf16 autocast over float32 master weights, and
plain float32) are exercised whichever CPU CI has."""

from __future__ import annotations

import json
import math

import pytest
import torch
from support import flags

from grpokit.errors import ConfigError
from grpokit.modeling import cpu_has_fast_bf16, resolve_dtype_name, torch_dtype

# numerics: run again by .ci/run under the other dtype choice and torch's default thread count;
# the --torch_dtype auto rule itself, under either forced choice
pytestmark = [
    pytest.mark.numerics,
    pytest.mark.skipif(torch.cuda.is_available(), reason="auto follows the GPU there, not the CPU"),
]


def test_the_variable_forces_either_choice(monkeypatch):
    monkeypatch.setenv("GRPOKIT_CPU_BF16", "1")
    assert cpu_has_fast_bf16() and resolve_dtype_name("auto") == "bfloat16"
    assert torch_dtype("auto", for_training_weights=False) == torch.bfloat16
    assert torch_dtype("auto", for_training_weights=True) == torch.float32  # master weights stay float32
    monkeypatch.setenv("GRPOKIT_CPU_BF16", "0")
    assert not cpu_has_fast_bf16() and resolve_dtype_name("auto") == "float32"
    assert torch_dtype("auto", for_training_weights=False) == torch.float32
    assert resolve_dtype_name("bfloat16") == "bfloat16"  # an explicit dtype is never overridden


def test_unset_or_empty_detects_the_cpu(monkeypatch):
    from pathlib import Path

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    detected = "avx512_bf16" in flags or "amx_bf16" in flags
    monkeypatch.delenv("GRPOKIT_CPU_BF16", raising=False)
    assert cpu_has_fast_bf16() is detected
    monkeypatch.setenv("GRPOKIT_CPU_BF16", "")
    assert cpu_has_fast_bf16() is detected


def test_another_value_is_a_config_error(monkeypatch):
    monkeypatch.setenv("GRPOKIT_CPU_BF16", "yes")
    with pytest.raises(ConfigError, match="GRPOKIT_CPU_BF16='yes': use 1 .* or 0"):
        resolve_dtype_name("auto")


@pytest.mark.slow
def test_one_training_step_with_auto_takes_the_chosen_path(tiny_model_dir, math_jsonl, tmp_path):
    """Whatever GRPOKIT_CPU_BF16 says (or the CPU, when unset): bf16 autocast over float32 weights, or float32."""
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    bf16 = resolve_dtype_name("auto") == "bfloat16"
    out = tmp_path / "out"
    trainer = run_train(
        parse_train_args(
            flags(
                "--model",
                str(tiny_model_dir),
                "--tuner_type full",  # a reference model of its own, whose dtype is checked
                "--dataset",
                str(math_jsonl),
                "--output_dir",
                str(out),
                "--max_steps 1 --num_generations 2 --per_device_train_batch_size 4",
                "--max_completion_length 8 --beta 0.04 --torch_dtype auto --disable_tqdm true",
                "--plots false --save_final_model false",
            )
        )
    )
    assert trainer.accelerator.mixed_precision == ("bf16" if bf16 else "no")
    assert next(trainer.policy.parameters()).dtype == torch.float32
    assert next(trainer.ref_model.parameters()).dtype == (torch.bfloat16 if bf16 else torch.float32)
    (row,) = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and math.isfinite(row["loss"]) and math.isfinite(row["kl"])
