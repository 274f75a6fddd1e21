"""``toolbench``: a ReAct tool call (or final answer) compared with the ground truth in the ``solution`` column.

The solution is written the way the model should answer: ``Action: name`` + ``Action Input: {json}``, or a plain
final answer (optionally after ``Final Answer:``). Scores, each in [0, 1]:

- the solution calls a tool: 0 when the predicted action name differs; otherwise the argument F1. With JSON
  objects on both sides a key with the same value counts 1 and a key with another value 0.5 (as ms-swift);
  precision = matched / predicted keys, recall = matched / reference keys. Two non-JSON inputs are compared by
  ROUGE-L F1; a JSON input against a non-JSON one scores 0.
- the solution is a plain answer: 0 when the prediction calls a tool, else ROUGE-L F1 of the two answers.

ms-swift rounds this to 1/0 (F1 == 1) and uses the ``rouge`` package; grpokit returns the F1 itself (a denser
signal) and computes ROUGE-L by hand (longest common subsequence of lower-cased word tokens).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from grpokit.rewards.base import ORM, orms
from grpokit.wire.json_text import loads

_MAX_TOKENS = 1000  # ROUGE-L is O(n·m); longer texts are cut to their first 1000 tokens
_SPECIAL = ("<|endoftext|>", "<|im_end|>")


class ReactStep(NamedTuple):
    action: str | None  # None: no tool call (a plain answer)
    action_input: str
    answer: str


def parse_react(text: str) -> ReactStep:
    """The last ``Action:``/``Action Input:`` pair of a ReAct text, or its final answer when it calls no tool."""
    for tok in _SPECIAL:
        text = text.replace(tok, "")
    text = text.strip()
    if "Action:" not in text:
        answer = text.split("Final Answer:")[-1].strip()
        return ReactStep(None, "", answer)
    tail = text[text.rindex("Action:") + len("Action:") :]
    tail = tail.split("Observation:")[0]  # a model that invents the tool's reply: ignore the invention
    if "Action Input:" in tail:
        name, action_input = tail.split("Action Input:", 1)
    else:
        name, action_input = tail, "{}"
    return ReactStep(name.strip(), action_input.strip(), "")


def _tokens(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())[:_MAX_TOKENS]


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 (β = 1) of two texts over lower-cased word tokens; 0 when either is empty."""
    a, b = _tokens(candidate), _tokens(reference)
    if not a or not b:
        return 0.0
    prev = [0] * (len(b) + 1)  # LCS table, one row at a time
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)


def _json(text: str) -> tuple[bool, Any]:
    try:
        return True, loads(text)  # model-written: bounded (wire/json_text.py)
    except (ValueError, TypeError):
        return False, text


def argument_f1(predicted: str, reference: str) -> float:
    """F1 of predicted tool arguments against the reference (see the module docstring for the rules)."""
    pred_ok, pred = _json(predicted)
    ref_ok, ref = _json(reference)
    if pred_ok != ref_ok:
        return 0.0
    if not ref_ok:
        return rouge_l(pred, ref)
    if not isinstance(ref, dict) or not isinstance(pred, dict):
        return float(pred == ref)
    if not ref:
        return float(not pred)
    full = sum(1 for k, v in ref.items() if k in pred and pred[k] == v)
    half = sum(1 for k, v in ref.items() if k in pred and pred[k] != v)
    matched = full + 0.5 * half
    if matched == 0:
        return 0.0
    precision, recall = matched / len(pred), matched / len(ref)
    return 2 * precision * recall / (precision + recall)


def toolbench_score(prediction: str, solution: str) -> float:
    """Score one ReAct prediction against its ground truth, in [0, 1]."""
    ref, pred = parse_react(solution), parse_react(prediction)
    if ref.action is None:
        return 0.0 if pred.action is not None else rouge_l(pred.answer, ref.answer)
    if pred.action != ref.action:
        return 0.0
    return argument_f1(pred.action_input, ref.action_input)


class ReactORM(ORM):
    """ToolBench-style reward: action name match and argument F1, or ROUGE-L of a plain final answer."""

    def __call__(self, completions: list[str], solution: list[Any], **kwargs: Any) -> list[float | None]:
        return [
            None if sol is None else toolbench_score(c, str(sol)) for c, sol in zip(completions, solution, strict=True)
        ]


orms["toolbench"] = ReactORM
