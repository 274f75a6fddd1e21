"""Options that ms-swift accepts where they can have no effect, and that grpokit accepts the same way: one start-up
warning each (rank 0) saying what happens and what to add, and the run goes on, so that ms-swift's scripts run as
written. Only what cannot lose data or change a result is let through here; a typo in a tracker's name, or
``none`` mixed with trackers, is still refused.

- ``--eval_steps N`` / ``--eval_on_start true`` without validation data: ms-swift's ``split_dataset_ratio``
  defaults to 0, and without a validation set it sets ``eval_strategy`` to ``no`` and trains; grpokit's trainer
  evaluates only when it holds validation rows, so it does the same.
- ``--report_to NAME`` whose package is not installed: ms-swift installs tensorboard with itself, so its scripts
  name it freely; grpokit does not depend on any tracker. The run reports to the trackers that are installed, and
  ``logging.jsonl`` in the output folder holds every metric whatever the trackers are.
"""

from __future__ import annotations

import logging

from grpokit.config.swift_options import is_rank0
from grpokit.errors import ConfigError

logger = logging.getLogger(__name__)


def installed_trackers(names: list[str]) -> list[str]:
    """The trackers of ``--report_to`` that accelerate can load here (``all``: every installed one)."""
    from accelerate.tracking import get_available_trackers  # accelerate loads on first use: --help stays fast

    available = [str(getattr(t, "value", t)) for t in get_available_trackers()]
    if "all" in names:
        return available
    return [n for n in names if n != "none" and n in available]


def tracker_warning(names: list[str]) -> str | None:
    """Refuse a misspelt ``--report_to``; for trackers that are not installed, the one start-up line to warn."""
    from accelerate.utils import LoggerType

    known = [t.value for t in LoggerType]
    if "none" in names and len(names) > 1:
        raise ConfigError(f"--report_to {' '.join(names)}: none means no tracker; give none alone or only trackers")
    for name in names:
        if name != "none" and name not in known:
            raise ConfigError(f"--report_to {name}: unknown tracker; use none or one of {', '.join(known)}")
    wanted = [n for n in names if n != "none"]
    if not wanted:
        return None
    kept = installed_trackers(wanted)
    missing = [n for n in wanted if n != "all" and n not in kept]
    if "all" in wanted and not kept:
        missing.append("tensorboard")  # `all` with nothing installed: name the tracker ms-swift would have used
    if not missing:
        return None
    to = f"to {', '.join(kept)} and to logging.jsonl" if kept else "only to logging.jsonl"
    return (
        f"--report_to {' '.join(wanted)}: {', '.join(missing)} not installed, so the run reports {to} (which "
        f"holds every metric); pip install {' '.join(missing)} to use it (ms-swift installs tensorboard with "
        "itself)"
    )


def evaluation_warning(
    eval_steps: int | None, eval_on_start: bool, has_validation: bool, eval_on_end: bool = False
) -> str | None:
    """``--eval_steps`` / ``--eval_on_start`` / ``--eval_on_end`` without validation data: the line to warn, or
    None."""
    asked = (
        f"--eval_steps {eval_steps}"
        if eval_steps
        else "--eval_on_start true"
        if eval_on_start
        else "--eval_on_end true"
        if eval_on_end
        else None
    )
    if asked is None or has_validation:
        return None
    return (
        f"{asked} without validation data: no evaluation runs (as in ms-swift, whose split_dataset_ratio "
        "defaults to 0 and which then sets eval_strategy no); add --val_dataset FILE (or --split_dataset_ratio "
        "0.1 to hold out part of --dataset) to evaluate"
    )


def warn_moot_options(cfg, supplied_eval: bool = False) -> list[str]:
    """Check and warn (rank 0, once each) about the moot options of a resolved TrainConfig; returns the lines.
    ``supplied_eval``: the caller gave evaluation rows (the TRL API's eval_dataset)."""
    t, d = cfg.training, cfg.data
    validation = bool(d.val_dataset or d.split_dataset_ratio or supplied_eval)
    lines = [
        tracker_warning(t.report_to),
        evaluation_warning(t.eval_steps, t.eval_on_start, validation, t.eval_on_end),
    ]
    lines = [line for line in lines if line]
    if is_rank0():
        for line in lines:
            logger.warning(line)
    return lines
