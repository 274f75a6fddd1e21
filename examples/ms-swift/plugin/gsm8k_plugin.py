"""grpokit's counterpart of ms-swift's examples/train/grpo/plugin/gsm8k/gsm8k_plugin.py: the two rewards that
examples/ms-swift/plugin_gsm8k.sh names, registered under the same names (written for grpokit, same behaviour).

- ``gsm8k_accuracy``: 1.0 when the completion's final number (its last ``\\boxed{...}``, else the number after its
  last ``####``) equals the solution's (compared as floats within 1e-5, else as text), otherwise 0.0.
- ``gsm8k_format``: 1.0 when the completion has a ``\\boxed{...}`` or a ``#### number`` at all.
"""

from __future__ import annotations

import re

from grpokit.rewards import ORM, orms

_BOXED = re.compile(r"\\boxed\{([^}]+)\}")
_HASHES = re.compile(r"####\s*([\-\d,\.\s]+)")
_TAIL_CHARS = 500  # only the end of a long completion holds its final answer


def final_number(text: str) -> str:
    """The last boxed answer, else the last '#### n' answer, without commas and spaces; '' when there is none."""
    tail = text[-_TAIL_CHARS:]
    for pattern in (_BOXED, _HASHES):
        found = pattern.findall(tail)
        if found:
            return found[-1].replace(",", "").replace(" ", "").strip()
    return ""


def same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a) - float(b)) < 1e-5
    except (ValueError, OverflowError):
        return a == b


class GSM8KAccuracy(ORM):
    def __call__(self, completions, solution, **kwargs) -> list[float]:
        scores = []
        for completion, reference in zip(completions, solution, strict=True):
            want, got = final_number(reference), final_number(completion)
            scores.append(1.0 if want and got and same_number(got, want) else 0.0)
        return scores


class GSM8KFormat(ORM):
    def __call__(self, completions, **kwargs) -> list[float]:
        return [1.0 if _BOXED.search(c) or re.search(r"####\s*[\-\d,\.]+", c) else 0.0 for c in completions]


orms["gsm8k_accuracy"] = GSM8KAccuracy
orms["gsm8k_format"] = GSM8KFormat
