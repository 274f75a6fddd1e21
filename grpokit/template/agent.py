"""Agent templates: how a row's ``tools`` column (a list of function schemas) reaches the prompt.

- unset (the default): the tools go to the tokenizer's chat template as its ``tools=`` argument, so the model sees
  them in the format it was trained on. They travel with the prompt (``grpokit.template.encode``), so every engine
  and a rollout server render the same.
- ``hermes``: the tools are written into the system message in the Hermes / Qwen2.5 function-calling format
  (``<tools>`` … ``</tools>``; calls come back as ``<tool_call>{"name": …, "arguments": …}</tool_call>``).
- ``react_en``: the system message becomes a ReAct prompt (Thought / Action / Action Input / Observation / Final
  Answer) listing the tools.
- ``react_grpo``: as react_en, with the reasoning in ``<think>…</think>`` before each ``Action:`` (the format the
  rewards ``react_format`` and ``toolbench`` score), for GRPO on tool calls.
All match the layout of ms-swift's agent templates of the same names (the instructions are worded by grpokit).
Other ms-swift agent templates are refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from grpokit.errors import ConfigError, DataError
from grpokit.template.encode import attach


def parse_tools(value: Any, where: str) -> list[dict]:
    """A row's ``tools``: a list of function schemas, or that list as JSON text (ms-swift stores it so)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: column 'tools' is not valid JSON ({exc.msg})") from None
    else:  # a list read by Arrow: every row's objects got the keys of all rows, as null; take those off again
        value = _without_nulls(value)
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(
            f"{where}: column 'tools' must be a list of function schemas (objects), got {type(value).__name__}"
        )
    for tool in value:
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise DataError(
                f"{where}: a tool has no name (keys: {', '.join(map(str, tool))}); use "
                '{"name": ..., "description": ..., "parameters": {...}} or OpenAI\'s '
                '{"type": "function", "function": {...}}'
            )
    return value


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _wrapped(tool: dict) -> dict:
    """OpenAI's form ``{"type": "function", "function": {...}}``."""
    return tool if "function" in tool else {"type": "function", "function": tool}


def _hermes(tools: list[dict], system: str | None) -> str:
    lines = "\n".join(json.dumps(_wrapped(t), ensure_ascii=False) for t in tools)
    head = f"{system}\n\n" if system else ""
    return (
        f"{head}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n"
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )


def _react_tools(tools: list[dict]) -> list[tuple[str, str, str]]:
    """(name, description, parameters as JSON text) of each tool, for the ReAct prompts."""
    out = []
    for tool in tools:
        f = tool.get("function", tool)
        params = f.get("parameters") or {}
        out.append(
            (
                f["name"],
                f.get("description", ""),
                params if isinstance(params, str) else json.dumps(params, ensure_ascii=False),
            )
        )
    return out


def _react_en(tools: list[dict], system: str | None) -> str:
    listed = _react_tools(tools)
    names = [name for name, _, _ in listed]
    described = [
        f"{name}: Call this tool to interact with the {name} API. What is the {name} API useful for? "
        f"{desc} Parameters: {params} Format the arguments as a JSON object."
        for name, desc, params in listed
    ]
    return (
        "Answer the following questions as best you can. You have access to the following tools:\n\n"
        + "\n\n".join(described)
        + "\n\nUse the following format:\n\nQuestion: the input question you must answer\n"
        "Thought: you should always think about what to do\n"
        f"Action: the action to take, should be one of [{','.join(names)}]\n"
        "Action Input: the input to the action\nObservation: the result of the action\n"
        "... (this Thought/Action/Action Input/Observation can be repeated zero or more times)\n"
        "Thought: I now know the final answer\nFinal Answer: the final answer to the original input question"
        "\n\nBegin!\n"
    )


def _react_grpo(tools: list[dict], system: str | None) -> str:
    """ms-swift's react_grpo layout (the markers the model writes and the rewards react_format and toolbench parse:
    ``<think>…</think>``, ``Action:``, ``Action Input:``, ``Observation:``, ``Final Answer:``; one line per tool with
    its name, description and JSON parameters), in grpokit's own, shorter words. Like react_en it replaces the
    system message."""
    listed = _react_tools(tools)
    names = [name for name, _, _ in listed]
    return (
        "Answer the user's question; call a tool when it helps. Each reply starts with your reasoning between "
        "<think> and </think>, then either a tool call or the answer.\n\nTools:\n\n"
        + "\n\n".join(f"{name}: {desc} Parameters: {params}" for name, desc, params in listed)
        + "\n\nReply layout:\n\n<think>what to do next</think>\n"
        f"Action: one name from [{','.join(names)}]\n"
        "Action Input: the arguments, as a JSON object\n"
        "Observation: the tool's result (written by the caller, not by you)\n"
        "... (think, Action, Action Input and Observation may repeat)\n"
        "Final Answer: your answer to the question\n\nBegin!\n"
    )


# name → (tools, system or None) → the new system message text
AGENT_TEMPLATES: dict[str, Callable[[list[dict], str | None], str]] = {
    "hermes": _hermes,
    "react_en": _react_en,
    "react_grpo": _react_grpo,
}


def check_agent_template(name: str | None) -> None:
    if name is not None and name not in AGENT_TEMPLATES:
        raise ConfigError(
            f"--agent_template {name}: not implemented in grpokit; use hermes, react_en or "
            "react_grpo, or leave it unset to render tools with the model's own chat template (its "
            "tools= argument)"
        )


def add_tools(messages: list[dict], tools: list[dict], agent_template: str | None) -> list[dict]:
    """The prompt with ``tools`` in it: in the system message (hermes, react_en, react_grpo) or as the chat
    template's tools."""
    messages = [dict(m) for m in messages]
    if not tools:
        return messages
    if agent_template is None:
        return attach(messages, tools=tools)
    has_system = messages[0]["role"] == "system"
    text = AGENT_TEMPLATES[agent_template](tools, messages[0]["content"] if has_system else None)
    if has_system:
        messages[0]["content"] = text
    else:
        messages.insert(0, {"role": "system", "content": text})
    return messages
