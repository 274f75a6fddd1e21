"""A GRPO plugin file as an ms-swift user writes one: ``from swift.…`` imports, classes registered in ms-swift's
registries under the names ms-swift's own example plugin uses. Written for grpokit's tests (no line taken from
ms-swift); tests/integration/third_party.py ports it the way a user ports theirs, by renaming the imports
(``swift.`` → ``grpokit.swift.``), and the porting tests train with the result.

It touches every extension point a ms-swift plugin reaches: outcome rewards (``ORM``) that read dataset columns,
``trajectory_inputs`` and ``request_id``; a sequence-classifier reward-model plugin (``template.encode``,
``template.data_collator``, ``to_device``); a causal-LM judge plugin that generates with ``TransformersEngine`` and
reads ``choice.message.content``; a multi-turn scheduler that edits the last message and masks what it inserts;
and an abstract gym ``Env``. This file is not collected by pytest (its name does
not start with ``test_``) and is never imported under its own name: ``swift`` is not a package here.
"""

import ast
import json
import operator
import re
from typing import List

import torch
from swift.infer_engine import RequestConfig, TransformersEngine
from swift.infer_engine.protocol import ChatCompletionResponse
from swift.rewards import ORM, orms, rm_plugins
from swift.rewards.rm_plugin import DefaultRMPlugin
from swift.rollout import multi_turns
from swift.rollout.gym_env import Env, envs
from swift.rollout.multi_turn import MultiTurnScheduler
from swift.template import Messages, Template
from swift.utils import get_logger, to_device

logger = get_logger()

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


class CountdownEquation(ORM):
    """1.0 when the text in <answer></answer> is an arithmetic expression that uses each of ``nums`` exactly once
    and evaluates to ``target``; 0.0 otherwise."""

    def __call__(self, completions, target, nums, **kwargs) -> List[float]:
        return [self._score(text, goal, numbers) for text, goal, numbers in zip(completions, target, nums)]

    @staticmethod
    def _score(text: str, goal, numbers) -> float:
        found = _ANSWER.search(text)
        expression = found.group(1).strip() if found else ""
        if not expression or not re.fullmatch(r"[\d+\-*/(). ]+", expression):
            return 0.0
        if sorted(int(n) for n in re.findall(r"\d+", expression)) != sorted(int(n) for n in numbers):
            return 0.0
        try:
            value = eval(expression, {"__builtins__": {}}, {})  # digits, operators and brackets only (checked)
        except (SyntaxError, ZeroDivisionError, TypeError):
            return 0.0
        return 1.0 if abs(float(value) - float(goal)) < 1e-6 else 0.0


class CodeBlockFormat(ORM):
    """1.0 when the completion holds a fenced code block in the language the row's ``verification_info`` names."""

    def __call__(self, completions, verification_info, **kwargs) -> List[float]:
        scores = []
        for text, info in zip(completions, verification_info):
            language = re.escape(str((info or {}).get("language", "python")))
            scores.append(1.0 if re.search(rf"```{language}\n.*?```", text, re.S) else 0.0)
        return scores


class LastRoundThinks(ORM):
    """Multi-turn: every round of a request gets the score of its last round, 1.0 when that round's reply closes
    a <think> block before answering."""

    def __call__(self, completions, trajectory_inputs, request_id, **kwargs) -> List[float]:
        scores = []
        for rid in request_id:
            last_round = trajectory_inputs[rid][-1]
            reply = last_round["messages"][-1]["content"] if last_round["messages"] else ""
            scores.append(1.0 if "</think>" in reply and reply.split("</think>")[-1].strip() else 0.0)
        return scores


def _tool_call(text: str):
    """The first <tool_call>{json}</tool_call> of ``text`` as a dict with a name, or None."""
    found = _TOOL_CALL.search(text or "")
    if not found:
        return None
    try:
        call = json.loads(found.group(1))
    except json.JSONDecodeError:
        return None
    return call if isinstance(call, dict) and isinstance(call.get("name"), str) else None


class ToolCallFormat(ORM):
    """1.0 for a well-formed tool call (or a plain <answer> when the reference is not a tool call), else 0.0."""

    def __call__(self, completions, solution, **kwargs) -> List[float]:
        return [
            float(_tool_call(text) is not None if _tool_call(ref) else bool(_ANSWER.search(text)))
            for text, ref in zip(completions, solution)
        ]


class ToolCallLength(ORM):
    """A length shaping term in [0, 1]: replies up to ``budget`` characters score 1, longer ones less."""

    budget = 400

    def __call__(self, completions, **kwargs) -> List[float]:
        return [min(1.0, self.budget / max(len(text), 1)) for text in completions]


class ToolCallCorrect(ORM):
    """Against a reference tool call: 1 for the right tool name, 2 more for the same parameters (at most 3).
    Against a plain reference answer: 1 when the <answer> text matches it."""

    def __call__(self, completions, solution, **kwargs) -> List[float]:
        scores = []
        for text, ref in zip(completions, solution):
            want = _tool_call(ref)
            if want is None:
                got, expected = _ANSWER.search(text), _ANSWER.search(ref)
                scores.append(float(bool(got and expected and got.group(1).strip() == expected.group(1).strip())))
                continue
            call = _tool_call(text)
            score = 0.0
            if call is not None and call["name"] == want["name"]:
                score = 1.0 + (2.0 if call.get("parameters") == want.get("parameters") else 0.0)
            scores.append(score)
        return scores


orms["external_countdown"] = CountdownEquation
orms["external_code_format"] = CodeBlockFormat
orms["thinking_tips"] = LastRoundThinks
orms["external_tooluse_format_reward"] = ToolCallFormat
orms["external_tooluse_length_reward"] = ToolCallLength
orms["external_tooluse_correct_reward"] = ToolCallCorrect


class FirstLogitRM(DefaultRMPlugin):
    """A sequence classifier's first logit per conversation, batched by hand: template.encode on each row,
    template.data_collator over them, the batch moved with to_device."""

    def __call__(self, inputs, **kwargs) -> List[float]:
        encoded = [self.template.encode(row) for row in inputs]
        batch = to_device(self.template.data_collator(encoded), next(self.model.parameters()).device)
        with torch.inference_mode():
            logits = self.model(**batch).logits
        return logits[:, 0].float().tolist()


class YesNoJudge:
    """A causal LM as judge: asked whether the reply answers the problem (the first user message) with the row's
    reference, it answers [[YES]] or [[NO]]; YES scores 1.0, anything else 0.0."""

    def __init__(self, model, template: Template):
        self.engine = TransformersEngine(model, template=template, max_batch_size=0)
        self.request_config = RequestConfig(temperature=0.0, max_tokens=8)

    @staticmethod
    def _question(messages: Messages, reference) -> Messages:
        problem, reply = messages[0]["content"], messages[-1]["content"]
        return [
            {
                "role": "user",
                "content": f"Problem: {problem}\nReference answer: {reference}\nReply: {reply}\n"
                "Does the reply reach the reference answer? Say [[YES]] or [[NO]].",
            }
        ]

    def __call__(self, inputs, **kwargs) -> List[float]:
        requests = [
            {"messages": self._question(row["messages"], (row.get("reward_model") or {}).get("ground_truth"))}
            for row in inputs
        ]
        responses: List[ChatCompletionResponse] = self.engine.infer(requests, self.request_config, use_tqdm=False)
        verdicts = [r.choices[0].message.content or "" for r in responses]
        logger.debug("judge verdicts: %s", verdicts)
        return [1.0 if "[[YES]]" in v else 0.0 for v in verdicts]


rm_plugins["my_rmplugin"] = FirstLogitRM
rm_plugins["qwenlong"] = YesNoJudge


_ACTION = re.compile(r"Action:\s*(\w+)\s*\nAction Input:\s*(.+?)\s*(?:\n|$)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _arithmetic(node):
    """The value of a +, -, *, / expression over numbers; ValueError for anything else."""
    if isinstance(node, ast.Expression):
        return _arithmetic(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_arithmetic(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arithmetic(node.left), _arithmetic(node.right))
    raise ValueError("only numbers and + - * / are allowed")


class CalculatorInReply(MultiTurnScheduler):
    """ReAct calls to a calculator, answered inside the same assistant message: the reply gets ``Result: N``
    appended and generation continues from there. The inserted tokens are masked out of the loss."""

    def check_finished(self, infer_request, response_choice, current_turn) -> bool:
        if not _ACTION.search(response_choice.message.content or ""):
            return True
        return super().check_finished(infer_request, response_choice, current_turn)

    def step(self, infer_request, response_choice, current_turn) -> dict:
        name, expression = _ACTION.search(response_choice.message.content).groups()
        try:
            value = _arithmetic(ast.parse(expression, mode="eval")) if name == "calculator" else None
            result = f"Result: {value:g}" if value is not None else f"Result: unknown tool {name}"
        except (SyntaxError, ValueError, ZeroDivisionError) as exc:
            result = f"Result: error: {exc}"
        infer_request.messages[-1]["content"] += result
        inserted = self.tokenizer.encode(result, add_special_tokens=False)
        token_ids = list(response_choice.token_ids) + inserted
        return {
            "infer_request": infer_request,
            "response_token_ids": token_ids,
            "response_loss_mask": [1] * len(response_choice.token_ids) + [0] * len(inserted),
            "rollout_infos": {"tool_results": result, "num_turns": current_turn},
        }


multi_turns["calculator_in_reply"] = CalculatorInReply


class CustomEnv(Env):
    """Left for the user to fill in: neither reset nor step is defined, so it stays abstract."""


envs["custom_env"] = CustomEnv
