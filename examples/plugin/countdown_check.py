"""Countdown answers, checked exactly: shared by the plugin's reward, judge, scheduler and environment.

``plugin.py`` imports this file as a sibling module (``from countdown_check import check``): ``--external_plugins``
puts the plugin's folder on ``sys.path``, so helpers next to a plugin need no installing.

The rules: the last ``<answer>…</answer>`` of a reply holds an arithmetic expression over whole numbers with
``+ - * /`` and parentheses; it must use each of ``nums`` exactly once (no other numbers) and equal ``target``.
Division is exact (``Fraction``), so ``(7 / 2) * 2`` is 7 and ``7 / 2`` is not 3. A trailing ``= <number>``
(``(4 + 2) * 3 = 18``) is allowed and ignored: the left side is what is checked.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_RESULT_RE = re.compile(r"(.*?)=\s*-?\d+\s*", re.DOTALL)  # "expression = 18"
MAX_EQUATION_CHARS = 200  # longer "equations" are not answers; also bounds the size of what is evaluated
_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


@dataclass(frozen=True)
class Verdict:
    """What the checker found in one reply."""

    equation: str | None  # text of the last <answer></answer>; None when the reply has none
    value: Fraction | None  # exact value of the equation; None when it is not a valid expression
    uses_numbers: bool  # each of nums used exactly once and no other number
    correct: bool  # uses_numbers and value == target
    reason: str  # one sentence for feedback: what is wrong, or "correct"


def last_answer(text: str) -> str | None:
    """The stripped text inside the last ``<answer>…</answer>``, or None."""
    found = ANSWER_RE.findall(text or "")
    return found[-1].strip() if found else None


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """Exact value of the expression and the numbers it uses, in order. ValueError for anything else."""
    stated = _RESULT_RE.fullmatch(expression)
    if stated:
        expression = stated.group(1)
    if len(expression) > MAX_EQUATION_CHARS:
        raise ValueError(f"longer than {MAX_EQUATION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise ValueError("not an arithmetic expression") from e
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("divides by zero")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise ValueError("uses something other than whole numbers, + - * / and parentheses")

    return walk(tree.body), used


def check(reply: str, nums: Iterable[int], target: int) -> Verdict:
    """Check one reply against its problem (``nums``, ``target`` as in ``builtin:countdown`` rows)."""
    nums, target = sorted(int(n) for n in nums), int(target)
    equation = last_answer(reply)
    if equation is None:
        return Verdict(None, None, False, False, "there is no <answer>...</answer>")
    try:
        value, used = evaluate(equation)
    except ValueError as e:
        return Verdict(equation, None, False, False, f"the answer {equation!r} {e}")
    uses = sorted(used) == nums
    shown = f"{value.numerator}/{value.denominator}" if value.denominator != 1 else str(value.numerator)
    if not uses:
        return Verdict(
            equation,
            value,
            False,
            False,
            f"the answer uses {sorted(used)}, but the numbers are {nums}, each exactly once",
        )
    if value != target:
        return Verdict(equation, value, True, False, f"{equation} = {shown}, not {target}")
    return Verdict(equation, value, True, True, "correct")
