"""``external_r1v_acc``: the accuracy reward of ms-swift's multimodal GRPO examples (R1-V style).

A completion scores 1.0 when math-verify finds its answer equal to the solution's, else when they are equal as
strings, else 0.0; an answer is the ``<answer>…</answer>`` content, or the whole text where there is no tag, stripped.
(ms-swift hands the whole completion to math-verify, which misses a bare "1/2" inside the tags; grpokit parses the
tagged answer.) Rows without a solution are not scored (None). Like every reward it also receives the
row's ``images`` column, which this one does not need.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from grpokit.rewards.base import ORM, orms

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TIMEOUT_S = 5


def _tagged(text: str) -> str:
    match = _ANSWER_RE.search(text)
    return match.group(1).strip() if match else text.strip()


def _math_equal(completion: str, solution: str) -> bool:
    """math-verify on the tagged answers (the whole text where untagged); its timeout is signal-based, so only
    on the main thread."""
    from math_verify import parse, verify  # not at the top: math-verify costs ~1 s to import

    timeout = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(_tagged(solution), parsing_timeout=timeout)
        pred = parse(_tagged(completion), parsing_timeout=timeout)
        return bool(gold) and bool(pred) and float(verify(gold, pred, timeout_seconds=timeout)) > 0
    except Exception:  # noqa: BLE001 - math-verify raises on text it cannot parse: fall back to strings
        return False


def r1v_accuracy(completion: str, solution: str) -> float:
    """1.0 when math-verify agrees, else when the tagged answers match as strings."""
    if _math_equal(completion, solution):
        return 1.0
    return float(_tagged(completion) == _tagged(solution))


@orms.register("external_r1v_acc")
class MultiModalAccuracyORM(ORM):
    """math-verify first, then the ``<answer>`` string (ms-swift's ``external_r1v_acc``)."""

    def __call__(self, completions: list[str], solution: list[Any], **kwargs: Any) -> list[float | None]:
        return [
            None if sol is None else r1v_accuracy(c, str(sol)) for c, sol in zip(completions, solution, strict=True)
        ]
