"""Options ms-swift accepts where they have no effect (grpokit.config.moot): one start-up warning, and the run
goes on as ms-swift's would; a misspelt tracker is still refused."""

from __future__ import annotations

import logging

import pytest

from grpokit.config.moot import installed_trackers
from grpokit.config.parse import parse_train_args
from grpokit.errors import ConfigError

ARITH = ["--dataset", "builtin:arithmetic"]


def _warnings(caplog, *flags: str) -> list[str]:
    with caplog.at_level(logging.WARNING, logger="grpokit.config.moot"):
        cfg = parse_train_args([*ARITH, *flags])
    lines = [r.getMessage() for r in caplog.records if r.name == "grpokit.config.moot"]
    return cfg, lines


@pytest.mark.parametrize("flags", [["--eval_steps", "100"], ["--eval_on_start", "true"]])
def test_evaluation_without_validation_data_is_one_warning_and_no_evaluation(caplog, flags):
    cfg, lines = _warnings(caplog, *flags)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{' '.join(flags)} without validation data: no evaluation runs (as in ms-swift")
    assert "add --val_dataset FILE" in lines[0]
    assert not cfg.data.val_dataset and not cfg.data.split_dataset_ratio  # nothing to evaluate on


def test_evaluation_with_a_held_out_split_warns_nothing(caplog):
    _, lines = _warnings(caplog, "--eval_steps", "100", "--split_dataset_ratio", "0.1")
    assert lines == []


def test_trackers_that_are_not_installed_are_one_warning_and_the_run_keeps_logging_jsonl(caplog, monkeypatch):
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: ["wandb"])  # as if only wandb were
    names = ["tensorboard", "swanlab"]
    cfg, lines = _warnings(caplog, "--report_to", *names)
    assert cfg.training.report_to == names  # the option as given, as ms-swift keeps it
    assert lines == [
        "--report_to tensorboard swanlab: tensorboard, swanlab not installed, so the run reports only to "
        "logging.jsonl (which holds every metric); pip install tensorboard swanlab to use it (ms-swift installs "
        "tensorboard with itself)"
    ]
    assert installed_trackers(names) == []  # what the Accelerator is given
    _, lines = _warnings(caplog, "--report_to", "wandb", "tensorboard")
    assert "so the run reports to wandb and to logging.jsonl" in lines[-1]
    assert installed_trackers(["wandb", "tensorboard"]) == ["wandb"]


@pytest.mark.parametrize(
    "names, said",
    [
        (["tensorbord"], "--report_to tensorbord: unknown tracker; use none or one of"),
        (["none", "wandb"], "--report_to none wandb: none means no tracker"),
    ],
)
def test_a_misspelt_tracker_is_still_refused(names, said):
    with pytest.raises(ConfigError, match=said):
        parse_train_args([*ARITH, "--report_to", *names])


def test_no_tracker_and_no_evaluation_warn_nothing(caplog):
    _, lines = _warnings(caplog, "--report_to", "none")
    assert lines == []
