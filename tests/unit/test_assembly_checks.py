"""A TrainConfig built in code meets the same checks as ``grpokit train``'s flags, in the one assembly
(``pipeline.train.assembled``), before any model loads."""

from __future__ import annotations

import pytest

from grpokit.config.args import (
    AlgorithmArguments,
    DataArguments,
    ModelArguments,
    RolloutArguments,
    TrainConfig,
    TrainingArguments,
)
from grpokit.config.checked import checked_config
from grpokit.config.parse import parse_train_args
from grpokit.config.reward_args import RewardArguments
from grpokit.errors import ConfigError
from grpokit.pipeline.train import run_train


def code_config(tmp_path, model=ModelArguments(), algorithm=AlgorithmArguments()) -> TrainConfig:
    return TrainConfig(
        model,
        DataArguments(),
        RolloutArguments(),
        algorithm,
        RewardArguments(),
        TrainingArguments(output_dir=str(tmp_path / "out")),
    )


def test_field_bounds_stop_a_config_built_in_code(tmp_path):
    # before the one gate, these loaded the model, trained a window and died: ZeroDivisionError (step % 0)
    cfg = code_config(
        tmp_path,
        ModelArguments(lora_rank=0),
        AlgorithmArguments(beta=0.04, sync_ref_model=True, ref_model_sync_steps=0),
    )
    with pytest.raises(ConfigError, match=r"^--lora_rank 0: must be ≥ 1") as err:
        run_train(cfg)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()  # nothing was made


def test_rules_between_options_stop_a_config_built_in_code(tmp_path):
    cfg = code_config(tmp_path, algorithm=AlgorithmArguments(beta=0.0, sync_ref_model=True))
    with pytest.raises(ConfigError, match=r"^--sync_ref_model true with --beta 0: "):
        run_train(cfg)


def test_a_parsed_config_passes_the_gate_once(tmp_path):
    parsed = parse_train_args(["--model", "m/x", "--output_dir", str(tmp_path)])
    assert checked_config(parsed) is parsed  # the parser's check stands: no second pass, no warning twice
    parsed.training.learning_rate = float("nan")  # changed after its check: checked again
    with pytest.raises(ConfigError, match=r"^--learning_rate nan"):
        checked_config(parsed)
