"""A rule-based process reward, registered in ``prms`` as ``arithmetic_steps`` (usable in ``--reward_funcs``).

It checks every line of the form ``Step k: a op b = c`` (op one of + - * × x / ÷) and scores 1 for a step whose
arithmetic is right, 0 otherwise; the reward is the fraction of right steps (``aggregate="mean"``). A completion
with no such line is not scored (None). It is an example of the ``PRM`` contract as much as a reward: a learned
PRM would implement ``score_steps`` with a model instead of a regex.
"""

from __future__ import annotations

import re
from typing import Any

from grpokit.rewards.base import PRM, prms

_NUM = r"-?\d+(?:\.\d+)?"
_STEP_RE = re.compile(
    rf"^\s*Step\s*\d+\s*:\s*({_NUM})\s*([-+*/×x÷])\s*({_NUM})\s*=\s*({_NUM})\s*\.?\s*$",
    re.IGNORECASE | re.MULTILINE,
)


def _apply(a: float, op: str, b: float) -> float | None:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op in "*×xX":
        return a * b
    return None if b == 0 else a / b


class ArithmeticStepPRM(PRM):
    """Per-step checker for ``Step k: a op b = c`` lines; reward = fraction of correct steps."""

    def __init__(self, args: Any = None, aggregate: str = "mean", tolerance: float = 1e-6) -> None:
        super().__init__(args, aggregate=aggregate)
        self.tolerance = tolerance

    def score_steps(self, completion: str, **row: Any) -> list[float]:
        """1.0 or 0.0 for each ``Step k: a op b = c`` line of the completion, in order."""
        scores = []
        for a, op, b, c in _STEP_RE.findall(completion):
            value = _apply(float(a), op, float(b))
            scores.append(float(value is not None and abs(value - float(c)) <= self.tolerance))
        return scores


prms["arithmetic_steps"] = ArithmeticStepPRM
