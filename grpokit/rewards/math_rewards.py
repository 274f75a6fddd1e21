"""Math correctness rewards: ``accuracy`` (math-verify) and ``math`` (``\\boxed{}`` + sympy).

``accuracy`` takes the completion's answer from, in order: the last ``<answer>…</answer>``, else the last
``\\boxed{…}``, else the last number in the text (so "12", "The answer is 12." and "7 + 5 = 12" all answer 12),
and checks it against the ``solution`` column with math-verify. ms-swift parses a tagless completion as LaTeX only
(``try_extract_without_anchor=False``), which scores a bare "12" as wrong; the last-number fallback is grpokit's.
A solution that math-verify cannot parse (e.g. "Paris") is compared as text instead (case and surrounding
whitespace/punctuation ignored).
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

from grpokit.rewards.base import ORM, orms

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A number not glued to a preceding word/digit (so the "-2" of "10-2" reads as 2): 12, -3, 1,000, 0.5, 3/4.
_NUMBER_RE = re.compile(r"(?<![\w.])(-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?)")
_TIMEOUT_S = 5  # math-verify's own per-call limit (signal based, so only on the main thread)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` (or ``\\fbox{…}``), braces balanced; None when there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
        j += 1
    return None  # unbalanced: the model stopped mid-box


def last_number(text: str) -> str | None:
    """The last number written in the text (thousands separators removed), or None."""
    found = _NUMBER_RE.findall(text)
    return found[-1].replace(",", "") if found else None


def extract_answer(completion: str) -> str | None:
    """The answer text of a completion: last <answer> tag, else last \\boxed{}, else last number."""
    tags = _ANSWER_RE.findall(completion)
    if tags:
        return tags[-1].strip() or None
    boxed = last_boxed(completion)
    if boxed is not None:
        return f"\\boxed{{{boxed}}}" if boxed else None
    return last_number(completion)


def _timeout() -> int | None:
    # math-verify arms SIGALRM, which Python allows only on the main thread; elsewhere run without its limit.
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parse_gold(solution: str, timeout: int | None) -> tuple:
    from math_verify import parse

    tags = _ANSWER_RE.findall(solution)
    return tuple(parse(tags[-1] if tags else solution, parsing_timeout=timeout))


_INTEGER_RE = re.compile(r"-?\d+")


def _plain(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().strip(".!").strip().lower()


def answer_matches(completion: str, solution: str) -> bool:
    """True when the completion's extracted answer equals the solution (math-verify, else plain text)."""
    solution = str(solution)
    if _INTEGER_RE.fullmatch(solution.strip()):  # math for sure: skip parsing the gold (~3 ms for each new one)
        answer = extract_answer(completion)
        return answer is not None and _verified(answer, solution)
    gold = _parse_gold(solution, _timeout())
    if not gold:  # not math: compare the tagged/boxed answer, or the whole reply, as text
        tags = _ANSWER_RE.findall(completion)
        answer = tags[-1] if tags else (last_boxed(completion) or completion)
        return _plain(answer) == _plain(solution)
    answer = extract_answer(completion)
    return answer is not None and _verified(answer, solution)


@functools.lru_cache(maxsize=65536)
def _verified(answer: str, solution: str) -> bool:
    """math-verify's verdict on an extracted answer, memoised: the completions of a group mostly repeat a few
    answers, and each parse + verify costs ~1-3 ms. Two plain integers (GSM8K-style answers) are compared
    directly, which is what math-verify concludes for them."""
    if _INTEGER_RE.fullmatch(answer) and _INTEGER_RE.fullmatch(solution.strip()):
        return int(answer) == int(solution)
    from math_verify import parse, verify

    timeout = _timeout()
    pred = parse(answer, parsing_timeout=timeout)
    if not pred:
        return False
    try:
        return bool(verify(list(_parse_gold(solution, timeout)), pred, timeout_seconds=timeout))
    except Exception:  # math-verify raises on exotic expressions; an unverifiable answer is not correct
        return False


class MathAccuracy(ORM):
    """1.0 when the completion's answer equals ``solution`` (math-verify), else 0.0."""

    def __call__(self, completions: list[str], solution: list[Any], **kwargs: Any) -> list[float | None]:
        return [
            None if sol is None else float(answer_matches(c, sol)) for c, sol in zip(completions, solution, strict=True)
        ]


# --- math: \boxed{} compared with sympy ---------------------------------------------------------------------------

_MAX_SYMPY_CHARS = 200  # longer expressions are compared as text only (sympy simplify can take very long)


def _clean_latex(text: str) -> str:
    text = re.sub(r"\\left|\\right|\\!|\\,|\\;|\$", "", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", text)  # \frac12 -> \frac{1}{2}
    return re.sub(r"\s+", "", text).rstrip(".")


def _to_sympy(latex: str) -> Any:
    from latex2sympy2_extended import latex2sympy

    try:
        return latex2sympy(latex)
    except Exception:
        return None


def sympy_equal(pred: str, gold: str) -> bool:
    """True when two LaTeX answers are equal as text after cleaning, or their sympy difference simplifies to 0."""
    a, b = _clean_latex(pred), _clean_latex(gold)
    if a == b:
        return True
    if not a or not b or max(len(a), len(b)) > _MAX_SYMPY_CHARS:
        return False
    ea, eb = _to_sympy(a), _to_sympy(b)
    if ea is None or eb is None:
        return False
    import sympy

    try:
        return bool(sympy.simplify(ea - eb) == 0)
    except Exception:  # e.g. comparing a set with a number
        return False


class MathORM(ORM):
    """1.0 when the last ``\\boxed{}`` of the completion equals the solution's under sympy; 0.0 otherwise.

    The solution is its own last ``\\boxed{}`` when it has one, else the text after ``# Answer``, else all of it.
    A completion without ``\\boxed{}`` scores 0.
    """

    @staticmethod
    def _gold(solution: str) -> str:
        boxed = last_boxed(solution)
        if boxed is not None:
            return boxed
        return solution.split("# Answer")[-1].strip()

    def __call__(self, completions: list[str], solution: list[Any], **kwargs: Any) -> list[float | None]:
        out: list[float | None] = []
        for completion, sol in zip(completions, solution, strict=True):
            if sol is None:
                out.append(None)
                continue
            pred = last_boxed(completion)
            out.append(float(pred is not None and sympy_equal(pred, self._gold(str(sol)))))
        return out


orms["accuracy"] = MathAccuracy
orms["math"] = MathORM
