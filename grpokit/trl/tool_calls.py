"""TRL's tool calls: an environment's tools, the JSON schemas the chat template shows, the model's
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks parsed, and each call run (sync or async) with
its failure given back to the model as ``{"error": ...}``, as TRL's loop does."""

from __future__ import annotations

import inspect
import re
from typing import Any

from grpokit.errors import ConfigError
from grpokit.wire.json_text import loads

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_methods(env: Any) -> list:
    """An environment's tools, as TRL lists them: public functions of its class but reset and get_reward."""
    return [
        getattr(env, name)
        for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def tool_schemas(tools: list) -> list[dict]:
    from transformers.utils import get_json_schema  # not at the top: transformers loads with the run

    out = []
    for tool in tools:
        try:
            out.append(get_json_schema(tool))
        except Exception as e:  # noqa: BLE001 - transformers raises its own error types for undocumented tools
            raise ConfigError(
                f"GRPOTrainer(tools=[{getattr(tool, '__name__', tool)!r}]): no JSON schema can be made "
                f"({str(e).splitlines()[0]}); give it type hints and a Google-style docstring "
                "with an Args section"
            ) from None
    return out


def parse_tool_calls(text: str) -> list[dict] | None:
    """The reply's tool calls as {"name", "arguments"}; None when it calls none. A block that is not a JSON call
    object is a call of no tool (its error goes back to the model)."""
    calls = []
    for block in _TOOL_CALL.findall(text):
        try:
            call = loads(block, what="tool call")  # model-written: bounded (wire/json_text.py)
        except ValueError:
            call = None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append({"name": None, "arguments": {}, "raw": block[:200]})
            continue
        args = call.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = loads(args, what="arguments")
            except ValueError:
                args = {"__unparsed__": args}
        calls.append({"name": call["name"], "arguments": args if isinstance(args, dict) else {}})
    return calls or None


async def call_tool(tools: dict, call: dict) -> tuple[str, Any, bool]:
    """(name, result, failed): the tool's result, or ``{"error": ...}`` as TRL gives it back to the model."""
    name = call["name"] or "unknown"
    tool = tools.get(call["name"])
    try:
        if tool is None:
            raise ValueError(f"Tool {name} not found." if call["name"] else f"not a tool call: {call.get('raw')}")
        if "__unparsed__" in call["arguments"]:
            raise ValueError("the arguments are not a JSON object")
        result = tool(**call["arguments"])
        if inspect.isawaitable(result):
            result = await result
        return name, result, False
    except Exception as e:  # noqa: BLE001 - a tool's failure is the model's observation, as in TRL
        return name, {"error": str(e)}, True
