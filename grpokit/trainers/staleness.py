"""The staleness rules of the buffer of asynchronous training (group_buffer.py): how old a trajectory is when it
trains, and how many outstanding groups a window must take so that every later one stays within the bound."""

from __future__ import annotations

from collections.abc import Iterable


def age_metrics(step: int, outputs: list, versions: list[int]) -> dict[str, float]:
    """Staleness at optimizer step ``step``: each trajectory's age from its oldest token (``versions``: the
    version its rollout began with, where the tokens carry none), and how many span two versions or more."""
    oldest = [o.oldest_weight_version() for o in outputs]
    ages = [step - (start if v is None else v) for v, start in zip(oldest, versions, strict=True)]
    partial = sum(len({v for seg in o.weight_versions for v in seg}) > 1 for o in outputs)
    return {
        "async/staleness": max(ages),
        "async/staleness_max": max(ages),
        "async/staleness_mean": sum(ages) / len(ages),
        "async/partial_trajectories": float(partial),
    }


def must_take(versions: Iterable[int], step: int, *, max_staleness: int, steps_per_window: int, per_window: int) -> int:
    """How many of the outstanding groups (their ``versions``) the window training at ``step`` must still take
    so that every later window can train the groups due by its step: max over j ≥ 1 of (groups due within the
    first j windows) - (j - 1) windows of ``per_window`` groups."""
    must = 0
    for i, version in enumerate(sorted(versions)):
        window = max(1, (version + max_staleness - step) // steps_per_window + 1)
        must = max(must, i + 1 - (window - 1) * per_window)
    return must
