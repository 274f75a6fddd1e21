"""Render options that travel with a prompt: its tools and chat-template keyword arguments.

They ride on the prompt's first message as JSON text (keys ``tools`` and ``chat_template_kwargs``), so every
place that renders the conversation (the trainer, an in-process engine, a rollout server reading a request body,
a multi-turn scheduler's later turns, which extend the same message list) renders it the same way.
``ChatTemplate`` takes them off before calling the tokenizer's chat template.
"""

from __future__ import annotations

import json
from typing import Any

from grpokit.wire.json_text import loads

TOOLS_KEY = "tools"
KWARGS_KEY = "chat_template_kwargs"


def attach(messages: list[dict], *, tools: list[dict] | None = None, kwargs: dict | None = None) -> list[dict]:
    """A copy of ``messages`` whose first message carries ``tools`` and ``kwargs`` (each only when not empty)."""
    messages = [dict(m) for m in messages]
    if tools:
        messages[0][TOOLS_KEY] = json.dumps(tools, ensure_ascii=False)
    if kwargs:
        messages[0][KWARGS_KEY] = json.dumps(kwargs, ensure_ascii=False)
    return messages


def _loaded(value: Any, key: str) -> Any:
    """A carried value; JsonTextError (a ValueError) when its text is not JSON within bounds (a request body's)."""
    return loads(value, what=f"messages[0].{key}") if isinstance(value, str) else value


def detach(messages: list[dict]) -> tuple[list[dict], list[dict] | None, dict]:
    """Messages without the carried keys, the tools (None when none) and the keyword arguments they carried."""
    tools, kwargs, out = None, {}, []
    for m in messages:
        if TOOLS_KEY in m or KWARGS_KEY in m:
            if m.get(TOOLS_KEY) is not None and tools is None:
                tools = _loaded(m[TOOLS_KEY], TOOLS_KEY)
            if m.get(KWARGS_KEY) is not None and not kwargs:
                kwargs = _loaded(m[KWARGS_KEY], KWARGS_KEY)
                if not isinstance(kwargs, dict):
                    raise ValueError(f"messages[0].{KWARGS_KEY}: send a JSON object, got {kwargs!r:.40}")
                kwargs = dict(kwargs)
            m = {k: v for k, v in m.items() if k not in (TOOLS_KEY, KWARGS_KEY)}
        out.append(m)
    return out, tools, kwargs
