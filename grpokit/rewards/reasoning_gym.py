"""``--reward_funcs reasoning_gym``: the score a reasoning-gym task's own ``score_answer`` gives a completion.

It reads each row's ``reasoning_gym_entry`` (written by ``--dataset reasoning_gym:TASK…``, data/reasoning_gym.py),
regenerates that exact entry from the task's config, seed and index, and scores the answer: the text of the last
``<answer>…</answer>`` in the completion (reasoning-gym's own convention and extractor), else the whole completion
stripped. Scores are the task's (1.0 for a correct answer; some tasks give partial credit). A row without an entry
(another dataset mixed in) is not scored (None). A scorer that raises on a completion gives it 0.0: the completion
is the model's text, and a verdict that cannot be reached is no pass.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from grpokit.data.reasoning_gym import ENTRY_COLUMN, task_dataset
from grpokit.errors import RewardError
from grpokit.rewards.base import ORM, orms

logger = logging.getLogger(__name__)


def _answer(completion: str) -> str:
    # not at the top: the optional extra; rows with a reasoning_gym_entry exist only once it has loaded
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(completion)
    return completion.strip() if tagged is None else tagged


class ReasoningGymScore(ORM):
    """The task's scorer on each completion's answer."""

    def __call__(
        self, completions: list[str], reasoning_gym_entry: list[str | None], **kwargs: Any
    ) -> list[float | None]:
        scores: list[float | None] = []
        failed = 0
        for completion, ref_text in zip(completions, reasoning_gym_entry, strict=True):
            if ref_text is None:
                scores.append(None)
                continue
            ref = json.loads(ref_text)
            ds = task_dataset(ref["task"], ref["config"], option=f"--reward_funcs reasoning_gym ({ENTRY_COLUMN})")
            entry = ds[ref["index"]]
            if ref["answer"] is not None and str(entry["answer"]) != ref["answer"]:
                raise RewardError(
                    f"--reward_funcs reasoning_gym: entry {ref['index']} of {ref['task']} "
                    f"regenerates with answer {str(entry['answer'])[:40]!r}, not the row's "
                    f"{ref['answer'][:40]!r}; the data was built by another reasoning-gym version: "
                    "rebuild it with this one"
                )
            try:
                scores.append(float(ds.score_answer(answer=_answer(completion), entry=entry)))
            except Exception:  # noqa: BLE001 - the task's scorer on the model's text: any failure is no pass
                scores.append(0.0)
                failed += 1
        if failed:
            logger.warning(
                "reasoning_gym: the task's scorer raised on %d of %d completions; they score 0.0",
                failed,
                len(completions),
            )
        return scores


orms["reasoning_gym"] = ReasoningGymScore
