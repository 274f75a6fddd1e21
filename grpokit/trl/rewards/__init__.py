"""``trl.rewards``: the reward functions TRL 1.16 ships, with TRL's signatures, names and results.

``completions`` are TRL's conversational completions (``[{"role": "assistant", "content": ...}]`` per sample; a
plain string is taken as its own text). The answer checks use ``math_verify`` as TRL does: the gold solution is
parsed, the completion's first LaTeX answer (``\\boxed{}`` first) is extracted and the two compared; a gold
solution that does not parse gives ``None`` (the sample is not scored by this function).

- ``accuracy_reward(completions, solution, log_extra=None)``: 1.0 / 0.0 / None.
- ``reasoning_accuracy_reward(completions, solution, reasoning_delimiters=None, log_extra=None)``: the same on the
  text after the last reasoning delimiter (default ``</think>``); 0.0 when no delimiter closes the reasoning.
- ``think_format_reward(completions)``: 1.0 when the completion opens with one ``<think>...</think>`` block.
- ``get_cosine_scaled_reward(max_len, ...)``: correctness scaled by token length on a cosine (arXiv 2502.03373).
- ``get_repetition_penalty_reward(ngram_size=3, max_penalty=-1.0)``: the share of repeated n-grams of token ids,
  times ``max_penalty``.
- ``get_soft_overlong_punishment(max_completion_len, soft_punish_cache)``: DAPO's length penalty (arXiv 2503.14476,
  eq. 13): 0 up to ``max - cache`` tokens, then falling linearly to -1 at ``max``, -1 past it.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "accuracy_reward",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "reasoning_accuracy_reward",
    "think_format_reward",
]

_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def _text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    return completion[0]["content"]


def _timeouts() -> tuple[int | None, int | None]:
    """math_verify's timeouts use SIGALRM, which only the main thread may set: off elsewhere (and its warning)."""
    if threading.current_thread() is threading.main_thread():
        return 10, 5
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return None, None


def _grade(
    contents: list[str], solution: list[str], log_extra: Callable | None, skipped: list[str | None] | None = None
) -> list[float | None]:
    """math_verify's verdict per (content, solution); ``skipped[i]`` set: reward 0.0 with that note instead."""
    from math_verify import LatexExtractionConfig, parse, verify  # not at the top: an optional package
    from math_verify.parser import NormalizationConfig

    parse_timeout, verify_timeout = _timeouts()
    extraction = [
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(units=True),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]
    rewards: list[float | None] = []
    golds, answers = [], []
    for i, (content, sol) in enumerate(zip(contents, solution, strict=True)):
        note = skipped[i] if skipped else None
        if note is not None:
            rewards.append(0.0)
            golds.append(note)
            answers.append(note)
            continue
        gold = parse(sol, parsing_timeout=parse_timeout)
        if not gold:
            rewards.append(None)
            golds.append("[unparseable]")
            answers.append("[skipped]")
            continue
        answer = parse(
            content, extraction_config=extraction, extraction_mode="first_match", parsing_timeout=parse_timeout
        )
        rewards.append(float(verify(gold, answer, timeout_seconds=verify_timeout)))
        golds.append(str(gold))
        answers.append(str(answer) if answer else "[unparseable]")
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", golds)
        log_extra("answer_parsed", answers)
    return rewards


def accuracy_reward(
    completions: list, solution: list[str], log_extra: Callable | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion's answer equals the solution by math_verify, 0.0 when not, None when the solution
    does not parse."""
    return _grade([_text(c) for c in completions], solution, log_extra)


def reasoning_accuracy_reward(
    completions: list,
    solution: list[str],
    reasoning_delimiters: list[str] | None = None,
    log_extra: Callable | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """``accuracy_reward`` on what follows the reasoning; 0.0 (not None) when the reasoning never closes."""
    delimiters = reasoning_delimiters if reasoning_delimiters is not None else ["</think>"]
    contents, skipped = [], []
    for completion in completions:
        text = _text(completion)
        closing = next((d for d in delimiters if d in text), None)
        contents.append(text.split(closing)[-1] if closing is not None else text)
        skipped.append(None if closing is not None else "[incomplete reasoning]")
    return _grade(contents, solution, log_extra, skipped)


def think_format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion starts with ``<think>``, closes it with ``</think>`` and opens no second one."""
    return [1.0 if _THINK.match(_text(c)) else 0.0 for c in completions]


class _CosineScaled:
    __name__ = "cosine_scaled_reward"  # the reward's logged name, as in TRL

    def __init__(
        self,
        max_len: int,
        min_value_wrong: float,
        max_value_wrong: float,
        min_value_correct: float,
        max_value_correct: float,
    ) -> None:
        self.max_len = max_len
        self.wrong = (max_value_wrong, min_value_wrong)  # (at the longest, at the shortest): short wrong costs more
        self.correct = (min_value_correct, max_value_correct)  # short correct earns more

    def __call__(
        self, completions: list, solution: list[str], completion_ids: list[list[int]], **kwargs: Any
    ) -> list[float | None]:
        out: list[float | None] = []
        for correct, ids in zip(accuracy_reward(completions, solution), completion_ids, strict=True):
            if correct is None:
                out.append(None)
                continue
            low, high = self.correct if correct else self.wrong
            progress = min(len(ids) / self.max_len, 1.0)  # capped: the cosine would rise again past max_len
            out.append(float(low + 0.5 * (high - low) * (1.0 + math.cos(progress * math.pi))))
        return out


def get_cosine_scaled_reward(
    max_len: int,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> Callable:
    """A reward ``f(completions, solution, completion_ids)``: for a correct answer from ``max_value_correct``
    (0 tokens) down to ``min_value_correct`` (``max_len`` tokens); for a wrong one from ``min_value_wrong`` up to
    ``max_value_wrong``; None where the solution does not parse."""
    return _CosineScaled(max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)


class _RepetitionPenalty:
    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int, max_penalty: float) -> None:
        self.ngram_size, self.max_penalty = ngram_size, max_penalty

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        out = []
        for ids in completion_ids:
            n = self.ngram_size
            if len(ids) < n:
                out.append(0.0)
                continue
            grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
            repeated = 1 - len(set(grams)) / len(grams)
            out.append(repeated * self.max_penalty if repeated else 0.0)
        return out


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> Callable:
    """A reward ``f(completion_ids)``: ``max_penalty`` times the share of the completion's token n-grams that
    repeat an earlier one (0.0 for a completion shorter than one n-gram)."""
    if max_penalty > 0:
        raise ValueError(f"max_penalty {max_penalty} should not be positive")
    return _RepetitionPenalty(ngram_size, max_penalty)


class _SoftOverlong:
    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int) -> None:
        self.max_len, self.cache = max_completion_len, soft_punish_cache

    def __call__(self, completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        free = self.max_len - self.cache
        out = []
        for ids in completion_ids:
            n = len(ids)
            out.append(0.0 if n <= free else (free - n) / self.cache if n <= self.max_len else -1.0)
        return out


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable:
    """A reward ``f(completion_ids)``: 0 up to ``max_completion_len - soft_punish_cache`` tokens, then linearly
    down to -1 at ``max_completion_len``, and -1 beyond."""
    return _SoftOverlong(max_completion_len, soft_punish_cache)
