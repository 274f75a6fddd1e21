"""Every field of TRL 1.16's GRPOConfig is decided by grpokit.trl (passed on, renamed, converted, inert or refused
with its reason), and TRL's own defaults are the ones grpokit.trl starts from.

The field list is read from the real TRL package, installed once (``pip install --no-deps --target``, cached in
~/.cache/grpokit/trl-1.16.0) beside, not into, the test environment: its ``grpo_config.py`` and base config are
parsed, not imported, and the TrainingArguments fields come from the transformers this environment has."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from grpokit.errors import ConfigError
from grpokit.trl import GRPOConfig
from grpokit.trl.fields import CONVERTED, INERT, REFUSED, RENAMED, SAME, TRL_DEFAULTS, decided

TRL_VERSION = "1.16.0"


@pytest.fixture(scope="session")
def trl_package() -> Path:
    target = Path.home() / ".cache" / "grpokit" / f"trl-{TRL_VERSION}"
    config = target / "trl" / "trainer" / "grpo_config.py"
    if not config.is_file():
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            f"trl=={TRL_VERSION}",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and config.is_file(), (
            f"pip could not install trl=={TRL_VERSION} into {target} (is PyPI reachable?): {done.stderr[-500:]}"
        )
    return target / "trl" / "trainer"


def _class_fields(path: Path, name: str) -> dict[str, object]:
    """A dataclass's own fields and their defaults, read from its source (literal defaults only; None otherwise)."""
    out: dict[str, object] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == name:
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    value = stmt.value
                    if isinstance(value, ast.Call):
                        value = next((k.value for k in value.keywords if k.arg == "default"), None)
                    try:
                        out[stmt.target.id] = ast.literal_eval(value) if value is not None else None
                    except ValueError:
                        out[stmt.target.id] = None
    return out


@pytest.fixture(scope="session")
def trl_fields(trl_package) -> dict[str, object]:
    from transformers import TrainingArguments

    fields = {f.name: f.default for f in dataclasses.fields(TrainingArguments) if f.init}
    fields.update(_class_fields(trl_package / "base_config.py", "_BaseConfig"))
    fields.update(_class_fields(trl_package / "grpo_config.py", "GRPOConfig"))
    return fields


def test_every_trl_grpo_config_field_is_decided(trl_fields):
    assert len(trl_fields) > 180  # TRL 1.16's GRPOConfig with transformers' TrainingArguments: ~190 fields
    undecided = sorted(set(trl_fields) - decided())
    assert not undecided, f"GRPOConfig fields grpokit.trl does not decide: {undecided}"
    tables = [set(SAME), set(RENAMED), set(CONVERTED), set(INERT), set(REFUSED)]
    assert sum(len(t) for t in tables) == len(decided())  # no field decided twice


def test_trl_defaults_are_trls(trl_fields):
    """The defaults grpokit.trl starts from are TRL's own (its source, not our memory of it)."""
    for name, ours in TRL_DEFAULTS.items():
        assert trl_fields[name] == ours, (name, trl_fields[name], ours)
    args = GRPOConfig()
    assert (args.beta, args.loss_type, args.num_train_epochs, args.learning_rate) == (0.0, "dapo", 3.0, 1e-6)
    assert args.bf16 is True and args.vllm_importance_sampling_correction is True
    flags = args.flags()
    for option, value in (
        ("beta", "0.0"),
        ("loss_type", "dapo"),
        ("num_train_epochs", "3.0"),
        ("gradient_checkpointing", "true"),
        ("logging_steps", "10"),
        ("tuner_type", "full"),
        ("torch_dtype", "bfloat16"),
        ("logging_first_step", "false"),
    ):
        assert flags[flags.index(f"--{option}") + 1] == value, option


@pytest.mark.parametrize(
    ("fields", "option", "value"),
    [
        ({"fp16": True}, "torch_dtype", "float16"),
        ({"bf16": False}, "torch_dtype", "float32"),
        ({"model_init_kwargs": {"dtype": "bfloat16", "attn_implementation": "eager"}}, "attn_impl", "eager"),
        ({"scale_rewards": False}, "scale_rewards", "none"),
        ({"mask_truncated_completions": True}, "overlong_filter", "true"),
        ({"use_vllm": True}, "rollout_importance_sampling_mode", "sequence_mask"),
        ({"use_vllm": True, "vllm_importance_sampling_clip_max": 2.5}, "rollout_importance_sampling_threshold", "2.5"),
        ({"beta": 0.04}, "kl_bias_correction", "true"),
        ({"vllm_enable_sleep_mode": True}, "sleep_level", "2"),
        ({"report_to": "tensorboard"}, "report_to", "tensorboard"),
    ],
)
def test_fields_become_grpokit_options(fields, option, value):
    flags = GRPOConfig(output_dir="out", **fields).flags()
    assert flags[flags.index(f"--{option}") + 1] == value


def test_generation_kwargs_override_the_sampling_fields_and_dropout_goes():
    import torch

    from grpokit.pipeline.models import disable_dropout

    flags = GRPOConfig(top_k=0, generation_kwargs={"top_k": 5}, disable_dropout=True).flags()
    assert [flags[i + 1] for i, f in enumerate(flags) if f == "--top_k"][-1] == "5"  # the later flag wins
    assert flags[flags.index("--disable_dropout") + 1] == "true"
    with pytest.raises(ConfigError, match=r"^GRPOConfig\(generation_kwargs=\{'min_p': \.\.\.\}\): not supported"):
        GRPOConfig(generation_kwargs={"min_p": 0.1}).flags()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    disable_dropout(model, None)
    assert model[1].p == 0.0


def test_no_is_correction_without_vllm_and_none_when_turned_off():
    assert "--rollout_importance_sampling_mode" not in GRPOConfig().flags()
    off = GRPOConfig(use_vllm=True, vllm_importance_sampling_correction=False).flags()
    assert "--rollout_importance_sampling_mode" not in off
    assert "--kl_bias_correction" not in GRPOConfig(beta=0.04, use_bias_correction_kl=False).flags()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"use_liger_kernel": True}, r"^GRPOConfig\(use_liger_kernel=True\): not supported by grpokit; "),
        ({"entropy_coef": 0.01}, r"^GRPOConfig\(entropy_coef=0\.01\): not supported by grpokit; an entropy bonus"),
        ({"logging_steps": 0.1}, r"^GRPOConfig\(logging_steps=0\.1\): a fraction of the run"),
        ({"save_strategy": "epoch"}, r"^GRPOConfig\(save_strategy='epoch'\): not supported"),
        ({"model_init_kwargs": {"device_map": "auto"}}, r"^GRPOConfig\(model_init_kwargs=\{'device_map'"),
        ({"report_to": "wandb", "run_name": "x"}, r"^GRPOConfig\(run_name=\.\.\.\): naming the tracker's run"),
    ],
)
def test_refused_fields_stop_with_one_line(fields, message):
    with pytest.raises(ConfigError, match=message) as err:
        GRPOConfig(output_dir="out", **fields).flags()
    assert "\n" not in str(err.value)


def test_unknown_names_are_refused_and_grpokit_options_accepted():
    with pytest.raises(ConfigError, match=r"^GRPOConfig\(num_generation=\.\.\.\): no such field .* num_generations"):
        GRPOConfig(num_generation=4)
    flags = GRPOConfig(save_final_model=False, tuner_type="lora").flags()
    assert flags[flags.index("--save_final_model") + 1] == "false" and flags.count("--tuner_type") == 1
    args = GRPOConfig()
    args.max_steps = 2  # set after construction, as scripts do
    assert args.flags()[args.flags().index("--max_steps") + 1] == "2"
