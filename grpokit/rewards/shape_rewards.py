"""Rewards on the shape of a completion: ``format``, ``react_format``, ``cosine``, ``repetition``, ``soft_overlong``.

Defaults follow ms-swift: cosine −0.5 / 0.0 (wrong, short→long), 1.0 / 0.5 (correct, short→long); repetition
3-grams with a −1.0 maximum penalty. Token lengths come from ``response_token_ids`` (summed over the turns of a
multi-turn trajectory, as ms-swift does) when the trainer passes them, else from the tokenizer.
"""

from __future__ import annotations

import math
import re
from typing import Any

from grpokit.errors import ConfigError
from grpokit.rewards.base import ORM, orms
from grpokit.rewards.math_rewards import MathAccuracy

_FORMAT_RE = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
_REACT_RE = re.compile(r"^<think>.*?</think>\s*Action:.*?Action Input:.*?$", re.DOTALL | re.MULTILINE)


def token_lengths(
    completions: list[str], response_token_ids: list[Any] | None, tokenizer: Any, reward: str
) -> list[int]:
    """Completion lengths in tokens: from response_token_ids (a list, or one list per turn) else the tokenizer."""
    if response_token_ids is not None:
        if len(response_token_ids) != len(completions):
            raise ValueError(
                f"{reward}: response_token_ids has {len(response_token_ids)} entries for {len(completions)} completions"
            )
        return [
            sum(len(seg) for seg in ids) if ids and isinstance(ids[0], (list, tuple)) else len(ids or [])
            for ids in response_token_ids
        ]
    if tokenizer is None:
        raise ConfigError(
            f"--reward_funcs {reward}: needs token lengths but got neither response_token_ids nor a tokenizer; "
            "build it with build_reward_funcs(..., tokenizer=...)"
        )
    return [len(ids) for ids in tokenizer(list(completions), add_special_tokens=False)["input_ids"]]


class Format(ORM):
    """1.0 when the whole completion is ``<think>…</think>`` then ``<answer>…</answer>`` (whitespace between),
    else 0."""

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        return [1.0 if _FORMAT_RE.fullmatch(c) else 0.0 for c in completions]


class ReActFormat(ORM):
    """1.0 when the completion starts with ``<think>…</think>`` followed by ``Action:`` and ``Action Input:``."""

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        return [1.0 if _REACT_RE.match(c) else 0.0 for c in completions]


class CosineReward(ORM):
    """Length shaping of arXiv 2502.03373: correct answers earn more when short, wrong ones lose less when long.

    r(L) = r_L + (r_0 − r_L)·(1 + cos(π·L/L_max))/2 with L clipped to L_max, where (r_0, r_L) is
    (min_len_value_correct, max_len_value_correct) for a correct answer (``accuracy`` = 1) and
    (min_len_value_wrong, max_len_value_wrong) otherwise. ``cosine_max_len`` defaults to ``max_completion_length``,
    and to 1000 when neither is given.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        cosine_min_len_value_wrong: float = -0.5,
        cosine_max_len_value_wrong: float = 0.0,
        cosine_min_len_value_correct: float = 1.0,
        cosine_max_len_value_correct: float = 0.5,
        cosine_max_len: int | None = None,
        max_completion_length: int | None = None,
        accuracy_orm: Any = None,
    ) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.wrong = (float(cosine_min_len_value_wrong), float(cosine_max_len_value_wrong))
        self.correct = (float(cosine_min_len_value_correct), float(cosine_max_len_value_correct))
        max_len = next((v for v in (cosine_max_len, max_completion_length) if v is not None), 1000)
        if int(max_len) <= 0:
            raise ConfigError(
                f"--cosine_max_len {max_len}: the cosine reward needs a positive length scale; "
                "set --cosine_max_len or --max_completion_length"
            )
        self.max_len = int(max_len)
        self.accuracy_orm = accuracy_orm or MathAccuracy()

    @staticmethod
    def cosfn(length: int, max_len: int, value_at_0: float, value_at_max: float) -> float:
        """Cosine interpolation from value_at_0 (length 0) to value_at_max (length ≥ max_len)."""
        t = min(length, max_len) / max_len
        return value_at_max + (value_at_0 - value_at_max) * (1.0 + math.cos(math.pi * t)) / 2.0

    def __call__(
        self, completions: list[str], solution: list[Any], response_token_ids: list[Any] | None = None, **kwargs: Any
    ) -> list[float | None]:
        acc = self.accuracy_orm(completions, solution=solution, **kwargs)
        lengths = token_lengths(completions, response_token_ids, self.tokenizer, "cosine")
        out: list[float | None] = []
        for a, n in zip(acc, lengths, strict=True):
            if a is None:
                out.append(None)
                continue
            v0, v_max = self.correct if a >= 1.0 else self.wrong
            out.append(self.cosfn(n, self.max_len, v0, v_max))
        return out


class RepetitionPenalty(ORM):
    """(1 − distinct n-grams / n-grams) · max_penalty over lower-cased words; 0 for texts shorter than n words."""

    def __init__(self, repetition_n_grams: int = 3, repetition_max_penalty: float = -1.0) -> None:
        super().__init__()
        if int(repetition_n_grams) < 1:
            raise ConfigError(f"--repetition_n_grams {repetition_n_grams}: must be ≥ 1")
        if float(repetition_max_penalty) > 0:
            raise ConfigError(
                f"--repetition_max_penalty {repetition_max_penalty}: must be ≤ 0 (it is a penalty), e.g. -1.0"
            )
        self.n = int(repetition_n_grams)
        self.max_penalty = float(repetition_max_penalty)

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        out: list[float | None] = []
        for text in completions:
            words = text.lower().split()
            if len(words) < self.n:
                out.append(0.0)
                continue
            grams = list(zip(*(words[i:] for i in range(self.n))))
            out.append((1.0 - len(set(grams)) / len(grams)) * self.max_penalty + 0.0)  # + 0.0: no -0.0
        return out


class SoftOverlong(ORM):
    """DAPO's soft overlong punishment (arXiv 2503.14476): 0 up to max − cache tokens, then a linear ramp to −1.

    r = 0 if L ≤ max − cache; (max − cache − L) / cache if L ≤ max; −1 beyond max (ms-swift keeps
    falling past −1 there; the paper and grpokit stop at −1). ``soft_max_length`` defaults to
    ``max_completion_length``.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        soft_max_length: int | None = None,
        soft_cache_length: int | None = None,
        max_completion_length: int | None = None,
    ) -> None:
        super().__init__()
        max_len = soft_max_length if soft_max_length is not None else max_completion_length
        if max_len is None:
            raise ConfigError("--reward_funcs soft_overlong: needs --soft_max_length (or --max_completion_length)")
        if soft_cache_length is None:
            raise ConfigError("--reward_funcs soft_overlong: needs --soft_cache_length, e.g. a quarter of the maximum")
        if not 0 < int(soft_cache_length) < int(max_len):
            raise ConfigError(f"--soft_cache_length {soft_cache_length}: must be > 0 and < --soft_max_length {max_len}")
        self.tokenizer = tokenizer
        self.max_len = int(max_len)
        self.cache_len = int(soft_cache_length)

    def __call__(
        self, completions: list[str], response_token_ids: list[Any] | None = None, **kwargs: Any
    ) -> list[float | None]:
        expected = self.max_len - self.cache_len
        out: list[float | None] = []
        for n in token_lengths(completions, response_token_ids, self.tokenizer, "soft_overlong"):
            out.append(max(min((expected - n) / self.cache_len, 0.0), -1.0))
        return out


orms["format"] = Format
orms["react_format"] = ReActFormat
orms["cosine"] = CosineReward
orms["repetition"] = RepetitionPenalty
orms["soft_overlong"] = SoftOverlong
