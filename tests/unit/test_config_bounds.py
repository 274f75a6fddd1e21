"""Bounds on the fields (grpokit/config/fields.py): every numeric option has its range, NaN and inf are refused,
YAML values are checked against the field types, ``resolve`` fills the derived defaults and ``validate`` changes
nothing. Each bad value is one line naming the option, the value and what to write instead."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys

import pytest

from grpokit.config.args import (
    ALL_GROUPS,
    AlgorithmArguments,
    DataArguments,
    ModelArguments,
    RewardArguments,
    RolloutArguments,
    TrainConfig,
    TrainingArguments,
)
from grpokit.config.fields import BOUNDS, INT_LIMIT, kind_of, option_fields
from grpokit.config.parse import parse_train_args
from grpokit.errors import ConfigError

ARITH = ["--dataset", "builtin:arithmetic"]

# numeric options whose every finite value means something: reward values and weights may have either sign
ANY_FINITE = {
    "reward_weights": "a weight per reward, negative to penalise",
    "cosine_min_len_value_wrong": "a reward value",
    "cosine_max_len_value_wrong": "a reward value",
    "cosine_min_len_value_correct": "a reward value",
    "cosine_max_len_value_correct": "a reward value",
    "eval_pass_threshold": "a reward value",
}


def _error(*flags: str) -> str:
    with pytest.raises(ConfigError) as e:
        parse_train_args([*ARITH, *flags])
    message = str(e.value)
    assert "\n" not in message and message
    return message


def test_every_numeric_option_has_a_range():
    unbounded = []
    for name, (field, kind) in option_fields(ALL_GROUPS).items():
        if kind.base in (int, float) and BOUNDS not in field.metadata and name not in ANY_FINITE:
            unbounded.append(name)
    assert unbounded == [], f"give these options bounds in grpokit/config/args.py (_opt(..., ge=...)): {unbounded}"


def test_every_default_is_within_its_own_field():
    """A default outside its bounds would refuse every run that does not set the option."""
    from grpokit.config.fields import check_value

    for name, (field, kind) in option_fields(ALL_GROUPS).items():
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        check_value(name, field, kind, default)


@pytest.mark.parametrize(
    "flags, message",
    [
        # issue 30: the gaps, each with the line that now answers it
        (
            ["--sync_ref_model", "true", "--ref_model_sync_steps", "0"],
            "--ref_model_sync_steps 0: must be ≥ 1; the default is 512",
        ),
        (["--ref_model_mixup_alpha", "7"], "--ref_model_mixup_alpha 7.0: must be in [0, 1]; the default is 0.6"),
        (["--lora_rank", "0"], "--lora_rank 0: must be ≥ 1; the default is 8"),
        (["--adam_beta1", "1.5"], "--adam_beta1 1.5: must be in [0, 1); the default is 0.9"),
        (["--num_train_epochs", "-1"], "--num_train_epochs -1.0: must be > 0; the default is 1"),
        (["--sync_ref_model", "true", "--beta", "0"], "--sync_ref_model true with --beta 0: no reference model"),
        (["--sync_ref_model", "true", "--tuner_type", "lora"], "--sync_ref_model true with --tuner_type lora"),
        # issue 27: NaN, seeds, epochs, checkpoint limits, negative numbers as values
        (["--learning_rate", "nan"], "--learning_rate nan: must be a finite number > 0; the default is 1e-06"),
        (["--beta", "-inf"], "--beta -inf: must be a finite number ≥ 0; the default is 0.04"),
        (["--learning_rate", "-1e-5"], "--learning_rate -1e-05: must be > 0; the default is 1e-06"),
        (
            ["--seed", "-1"],
            "--seed -1: must be in [0, 4294967295] (the range numpy and torch seed from); the default is 42",
        ),
        (["--num_train_epochs", "0"], "--num_train_epochs 0.0: must be > 0; the default is 1"),
        (["--save_total_limit", "-2"], "--save_total_limit -2: must be ≥ -1 (unset, 0 or -1 keeps every checkpoint)"),
        (
            ["--max_steps", "0"],
            "--max_steps 0: must be -1, or ≥ 1 (-1: train --num_train_epochs instead); the default is -1",
        ),
        (["--top_k", "-2"], "--top_k -2: must be in [-1, 1048576] (-1 or 0 disables top-k); the default is -1"),
        (
            ["--reward_funcs", "accuracy", "format", "--reward_weights", "1", "nan"],
            "--reward_weights nan: must be a finite number",
        ),
        (["--vllm_server_port", "70000"], "--vllm_server_port 70000: must be in [1, 65535]"),
        (["--cosine_max_len", str(INT_LIMIT + 1)], f"--cosine_max_len {INT_LIMIT + 1}: must be at most {INT_LIMIT}"),
        (["--num_generations", "1e3"], "--num_generations 1e3: expected a whole number"),
        (["--vllm_mode", "local"], "--vllm_mode local: unknown value; use one of colocate, server"),
        (
            ["--lr_scheduler_type", "cosin"],
            "--lr_scheduler_type cosin: unknown; use one of transformers' schedules: linear, cosine",
        ),
        (["--code_exec_isolation", "docker"], "--code_exec_isolation docker: unknown; use one of bwrap, none"),
        (["--report_to", "tensorbord"], "--report_to tensorbord: unknown tracker; use none or one of all, "),
        (["--report_to", "none", "wandb"], "--report_to none wandb: none means no tracker"),
    ],
)
def test_bad_values_are_one_line_naming_option_value_and_fix(flags, message):
    assert _error(*flags).startswith(message)


@pytest.mark.parametrize(
    "flags, option, value",
    [
        (["--learning_rate", "1e-5"], "learning_rate", 1e-5),
        (["--repetition_max_penalty", "-0.5"], "repetition_max_penalty", -0.5),
        (["--cosine_min_len_value_wrong", "-1e-1"], "cosine_min_len_value_wrong", -0.1),
        (["--top_k", "-1"], "top_k", -1),
        (["--reward_funcs", "accuracy", "format", "--reward_weights", "-1e-1", "2"], "reward_weights", [-0.1, 2.0]),
        (["--max_steps", "-1"], "max_steps", -1),
    ],
)
def test_negative_numbers_are_values(flags, option, value):
    assert parse_train_args([*ARITH, *flags]).flat()[option] == value


def test_the_cli_answers_a_bad_value_in_one_line_before_loading_anything(tmp_path):
    """From outside the process: the crash case of issue 30 (a ZeroDivisionError after the model loaded) and the
    negative learning rate of issue 27 each end with one `grpokit: error:` line, no traceback, exit 2 is argparse's
    and 1 grpokit's."""
    for flags, needle in [
        (["--sync_ref_model", "true", "--ref_model_sync_steps", "0"], "--ref_model_sync_steps 0"),
        (["--learning_rate", "-1e-5"], "--learning_rate -1e-05: must be > 0"),
    ]:
        out = subprocess.run(
            [sys.executable, "-m", "grpokit", "train", *ARITH, "--output_dir", str(tmp_path), *flags],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert out.returncode != 0
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert lines[-1].startswith("grpokit: error: ") and needle in lines[-1], out.stderr
        assert "Traceback" not in out.stderr and "Traceback" not in out.stdout
        assert "batch plan" not in out.stdout  # refused before the pipeline started


# ---- YAML values against the field types ------------------------------------------------------------------------
def _yaml(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return parse_train_args(["--config", str(path)])


@pytest.mark.parametrize(
    "text, option, value",
    [
        ("reward_funcs: accuracy\n", "reward_funcs", ["accuracy"]),  # a scalar for a list: one name, not its letters
        ("dataset: builtin:arithmetic\n", "dataset", ["builtin:arithmetic"]),
        ("num_generations: 4.0\n", "num_generations", 4),
        ("learning_rate: 1e-5\n", "learning_rate", 1e-5),  # a string to YAML 1.1, read as the flag's text would be
        ("learning_rate: 3\n", "learning_rate", 3.0),
        ("use_vllm: 'yes'\nuse_cpu: 'false'\n", "use_vllm", True),
        ("reward_weights: 1\nreward_funcs: [accuracy]\n", "reward_weights", [1.0]),
        ("vllm_server_port: '8001'\n", "vllm_server_port", [8001]),
        ("max_length: null\n", "max_length", None),
        ("output_dir: 2024\n", "output_dir", "2024"),
        ("lr_scheduler_kwargs: {num_cycles: 0.5}\n", "lr_scheduler_kwargs", {"num_cycles": 0.5}),
        ("learning-rate: 2.0e-5\n", "learning_rate", 2e-5),  # the flag's hyphenated spelling: read, not dropped
    ],
)
def test_yaml_values_take_their_field_types(tmp_path, text, option, value):
    cfg = _yaml(tmp_path, "dataset: [builtin:arithmetic]\n" * ("dataset:" not in text) + text)
    got = cfg.flat()[option]
    if option == "output_dir":  # resolved against the working directory at the start (a reward may chdir)
        got = os.path.relpath(got)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize(
    "text, message",
    [
        ("num_generations: 4.5\n", "num_generations: 4.5 is not a whole number; write an integer such as 4"),
        ("seed: -1\n", "--seed -1: must be in [0, 4294967295]"),
        ("num_generations: eight\n", "num_generations: 'eight' is not a whole number"),
        (
            "num_generations: null\n",
            "num_generations: needs a value (a whole number); remove the line to keep the default",
        ),
        ("learning_rate: .nan\n", "--learning_rate nan: must be a finite number > 0"),
        ("num_generations: [4, 8]\n", "num_generations: expected one value (a whole number), got a list"),
        ("dataset: {train: a.jsonl}\n", "--dataset {'train': 'a.jsonl'}: expected text, got dict"),
        ("vllm_mode: local\n", "--vllm_mode local: unknown value; use one of colocate, server"),
        ("use_vllm: maybe\n", "use_vllm: 'maybe' is not true or false"),
        ("beta: true\n", "--beta True: expected a number, got bool"),
        ("config: other.yaml\n", "a config file cannot name another (config: ...); merge them"),
        ("1: 2\n", "unknown option 1"),
    ],
)
def test_bad_yaml_values_are_one_line(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        _yaml(tmp_path, "dataset: [builtin:arithmetic]\n" * ("dataset:" not in text) + text)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(tmp_path / "run.yaml") in str(e.value) or str(e.value).startswith("--")


# ---- resolve fills, validate does not change ---------------------------------------------------------------------
def test_validate_changes_nothing_and_resolve_is_pure_and_idempotent():
    from grpokit.config.resolve import resolve
    from grpokit.config.validate import validate

    cfg = parse_train_args(
        [
            *ARITH,
            "--loss_type",
            "real",
            "--num_generations",
            "4",
            "--per_device_train_batch_size",
            "8",
            "--max_new_tokens",
            "33",
            "--optim",
            "sgd",
            "--advantage_estimator",
            "rloo",
        ]
    )
    before = copy.deepcopy(cfg)
    validate(cfg)
    assert cfg == before
    again = resolve(cfg)
    assert again == cfg and again is not cfg


def test_resolve_fills_a_config_built_in_code():
    from grpokit.config.resolve import resolve

    cfg = TrainConfig(
        ModelArguments(),
        DataArguments(),
        RolloutArguments(max_new_tokens=40),
        AlgorithmArguments(advantage_estimator="rloo", loss_type="real", scale_rewards="group"),
        RewardArguments(),
        TrainingArguments(optim="adamw_torch", save_strategy="no", eval_steps=5),
    )
    before = copy.deepcopy(cfg)
    out = resolve(cfg)
    assert cfg == before  # the input is not changed
    assert out.rollout.max_completion_length == 40 and out.training.optimizer == "adamw"
    assert out.algorithm.kl_in_reward is True and out.algorithm.scale_rewards == "none"
    assert out.training.eval_steps is None  # --save_strategy no, eval_strategy unset: no evaluation


def test_validate_checks_the_fields_of_a_config_built_in_code():
    from grpokit.config.validate import validate

    cfg = TrainConfig(
        ModelArguments(),
        DataArguments(),
        RolloutArguments(),
        AlgorithmArguments(),
        RewardArguments(),
        TrainingArguments(learning_rate=float("nan")),
    )
    with pytest.raises(ConfigError, match=r"^--learning_rate nan: must be a finite number"):
        validate(cfg)


def test_field_kinds_cover_every_option_type():
    """Each option's type is one the generic check knows: bool, int, float, str, a Literal, a list of one of those,
    or one of those or None."""
    for name, (_, kind) in option_fields(ALL_GROUPS).items():
        assert kind.base in (bool, int, float, str), (name, kind)
    assert kind_of(list[int]).is_list and kind_of(int | None).optional


def test_docs_show_every_options_range():
    """docs/options.md's type column carries each bounded option's range, as the check words it."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "options.md").read_text()
    rows = dict(re.findall(r"^\| `--(\w+)` \| ([^|]+) \|", doc, flags=re.MULTILINE))
    for name, (field, _) in option_fields(ALL_GROUPS).items():
        bounds = field.metadata.get(BOUNDS)
        if bounds is not None:
            assert name in rows and bounds.describe() in rows[name], (
                f"docs/options.md: the row of --{name} should say {bounds.describe()!r}"
            )


@pytest.mark.parametrize(
    "config, flags, message",
    [
        (
            {"max_position_embeddings": 1024},
            ["--max_completion_length", "2000"],
            "--max_completion_length 2000: the model {m} holds 1024 positions (max_position_embeddings 1024 in its "
            "config.json), so completions would run past its context; use at most 1024",
        ),
        (
            {"text_config": {"max_position_embeddings": 256}},
            ["--max_new_tokens", "300"],
            "--max_new_tokens 300: the model {m} holds 256 positions",
        ),
        (
            {"max_position_embeddings": 1024},
            ["--max_length", "900", "--max_completion_length", "512"],
            "--max_length 900 + --max_completion_length 512 = 1412 tokens, but the model {m} holds 1024 positions",
        ),
    ],
)
def test_lengths_past_a_local_models_context_are_refused(tmp_path, config, flags, message):
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert _error("--model", str(tmp_path), *flags).startswith(message.format(m=tmp_path))


def test_a_rope_scaling_factor_widens_the_context_and_a_config_without_one_is_not_guessed(tmp_path):
    import json

    (tmp_path / "config.json").write_text(
        json.dumps({"max_position_embeddings": 1024, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    )
    assert parse_train_args([*ARITH, "--model", str(tmp_path), "--max_completion_length", "4000"])
    (tmp_path / "config.json").write_text("{}")
    assert parse_train_args([*ARITH, "--model", str(tmp_path), "--max_completion_length", "100000"])
