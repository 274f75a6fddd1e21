"""OpenAI's chat-completions format, in and out: the request body (bounded), its messages as the chat template
takes them, the tool-call parser, and the answer.

Tool calls are parsed in the Hermes / Qwen2.5 format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks in the completion become the message's ``tool_calls`` (OpenAI's shape: ``arguments`` as JSON text) and are
taken out of its ``content``. A block whose JSON does not parse within the bounds of ``grpokit.wire.json_text``
(nesting, number length), or has no string ``name``, stays in the content as text; a message's
``tool_calls[].function.arguments`` that are not such JSON reach the template as text. ``tools`` reach the prompt
as the tokenizer's chat template renders them (its ``tools=`` argument, carried on the first message:
``grpokit.template.encode``), as ``--agent_template`` unset does for datasets.
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from grpokit.protocol import (
    MAX_MESSAGES,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOKENS,
    RequestConfig,
    check_message,
    check_utf8,
    new_id,
)
from grpokit.template.encode import attach
from grpokit.wire.json_text import JsonTextError, loads

MAX_CHOICES = 64  # n of one call: every choice is a trajectory the trainer may keep
MAX_TOOLS = 128
MAX_MODEL_CHARS = 256
ROLES = ("system", "developer", "user", "assistant", "tool")

StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class ChatError(ValueError):
    """A body the endpoint refuses: ``status`` and a one-line message naming the field, the value and the fix."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ChatBody(BaseModel):
    """``POST /v1/chat/completions``. Unknown fields are refused (422), as the rollout server's other bodies."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=MAX_MODEL_CHARS, description="any name: the policy serves it")
    messages: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_MESSAGES)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    store: bool | None = None


def check_body(body: ChatBody) -> None:
    """What the field types cannot say; ChatError (400) naming the field and the fix."""
    if body.stream:
        raise ChatError(
            400, "stream true: streaming is not supported by grpokit's endpoint; send stream false (or leave it out)"
        )
    if body.top_logprobs:
        raise ChatError(
            400,
            f"top_logprobs {body.top_logprobs}: only the sampled tokens' logprobs are returned; "
            "send top_logprobs 0 (or leave it out) with logprobs true",
        )
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name):
            raise ChatError(
                400,
                f"{name} {getattr(body, name):g}: not supported (the trainer's logprobs assume the "
                "plain sampling distribution); send 0 or leave it out",
            )
    if body.store:
        raise ChatError(
            400, "store true: grpokit's endpoint stores no completions for later retrieval; send false or leave it out"
        )
    if (
        body.max_tokens is not None
        and body.max_completion_tokens is not None
        and body.max_tokens != body.max_completion_tokens
    ):
        raise ChatError(
            400,
            f"max_tokens {body.max_tokens} and max_completion_tokens {body.max_completion_tokens} "
            "differ; send one of them",
        )
    if body.temperature is not None and 0 < body.temperature < 0.01:
        raise ChatError(400, f"temperature {body.temperature:g}: must be 0 (greedy) or at least 0.01")
    try:
        check_utf8(body.model_dump(include={"model", "messages", "tools", "stop"}), "body")
    except ValueError as e:
        raise ChatError(400, str(e)) from None


def request_config(body: ChatBody, defaults: RequestConfig, *, fixed_sampling: bool) -> RequestConfig:
    """The engine's settings for this call: the body's, else ``defaults``; ``max_tokens`` at most the default's.
    ``fixed_sampling`` (an episode: the trainer's logps assume its --temperature / --top_p): a body that asks for
    other values is refused."""
    update: dict[str, Any] = {"n": body.n, "logprobs": True}
    for name in ("temperature", "top_p"):
        value = getattr(body, name)
        if value is None or value == getattr(defaults, name):
            continue
        if fixed_sampling:
            raise ChatError(
                400,
                f"{name} {value:g}: an episode samples at the trainer's --{name} "
                f"{getattr(defaults, name):g} (the loss's logprobs assume it); leave {name} out of "
                f"the call or train with --{name} {value:g}",
            )
        update[name] = value
    asked = body.max_completion_tokens or body.max_tokens
    if asked is not None:
        update["max_tokens"] = min(asked, defaults.max_tokens)
    if body.stop is not None:
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop)
        update["stop"] = list(dict.fromkeys([*defaults.stop, *stops]))[:MAX_STOP_STRINGS]
    if body.seed is not None:
        update["seed"] = body.seed
    return defaults.model_copy(update=update)


def template_messages(body: ChatBody) -> list[dict]:
    """The body's messages as the chat template takes them: content as text, a null content beside tool calls
    read as "", ``developer`` as ``system``, tool-call arguments as objects; the tools carried on the first."""
    out = []
    for i, m in enumerate(body.messages):
        role = m.get("role")
        if role not in ROLES:
            raise ChatError(400, f"messages[{i}].role {str(role)[:40]!r}: use one of {', '.join(ROLES)}")
        # keys a client sends as null (refusal, audio, function_call, ...) mean nothing to a chat template
        m = {k: v for k, v in m.items() if v is not None or k == "content"}
        m["role"] = "system" if role == "developer" else role
        if m.get("content") is None:
            m["content"] = ""
        if "tool_calls" in m:
            m["tool_calls"] = _template_tool_calls(m["tool_calls"], i)
            if not m["tool_calls"]:
                del m["tool_calls"]
        try:
            out.append(check_message(m, i))
        except ValueError as e:
            raise ChatError(400, str(e)) from None
    tools = _checked_tools(body.tools) if body.tools and body.tool_choice != "none" else None
    return attach(out, tools=tools) if tools else out


def _template_tool_calls(calls: Any, i: int) -> list[dict]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ChatError(400, f"messages[{i}].tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ChatError(
                400,
                f"messages[{i}].tool_calls[{k}] needs function.name; send OpenAI's "
                '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "{...}"}}',
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = loads(args, what="arguments") if args.strip() else {}
            except JsonTextError:
                pass  # not JSON within the bounds (deep, a huge number): the template renders the text as it came
        out.append({**call, "type": "function", "function": {**fn, "arguments": args}})
    return out


def _checked_tools(tools: list[dict]) -> list[dict]:
    for k, tool in enumerate(tools):
        fn = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatError(
                400,
                f'tools[{k}]: send OpenAI\'s {{"type": "function", "function": {{"name": ..., '
                '"parameters": {...}}}} (only function tools are supported)',
            )
    return tools


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content without the parsed blocks, OpenAI tool calls) of a Hermes-format completion."""
    calls, kept, last = [], [], 0
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = loads(m.group(1), what="tool call")
        except JsonTextError:  # not JSON within the bounds: the block stays in the content as text
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append(
            {
                "id": f"call_{new_id()}",
                "type": "function",
                "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
    kept.append(text[last:])
    return ("".join(kept).strip() if calls else text), calls


def reply_message(text: str, parse_tools: bool, single_call: bool = False) -> tuple[dict, str | None]:
    """The assistant message of a completion (tool calls parsed when the call offered tools) and, with tool
    calls, the finish reason ``tool_calls``."""
    if not parse_tools:
        return {"role": "assistant", "content": text}, None
    content, calls = parse_tool_calls(text)
    if not calls:
        return {"role": "assistant", "content": text}, None
    if single_call:  # parallel_tool_calls false
        calls = calls[:1]
    return {"role": "assistant", "content": content or None, "tool_calls": calls}, "tool_calls"


def token_logprobs(tokenizer, token_ids: list[int], logprobs: list[float]) -> dict:
    """OpenAI's ``logprobs`` of a choice: each sampled token as text, its bytes and its logprob."""
    content = []
    for t, lp in zip(token_ids, logprobs, strict=True):
        piece = tokenizer.decode([t])
        content.append({"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8")), "top_logprobs": []})
    return {"content": content, "refusal": None}


def completion_answer(
    model: str, choices: list[dict], prompt_tokens: int, completion_tokens: int, prompt_token_ids: list[int]
) -> dict:
    """The ``chat.completion`` object. Beside OpenAI's fields, ``prompt_token_ids`` (top level) and each choice's
    ``token_ids`` give the exact tokens (clients read them as extra fields)."""
    return {
        "id": f"chatcmpl-{new_id()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "prompt_token_ids": prompt_token_ids,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def models_answer(model: str) -> dict:
    """``GET /v1/models``: the one served model (any other name is served by it too)."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "grpokit"}]}
