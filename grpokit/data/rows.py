"""Rows → the normalised form: a ``messages`` prompt plus the row's other columns (ms-swift's conventions).

The columns that make up the prompt (see ``grpokit.data.columns``) are read, turned into ``messages`` and dropped;
every other column stays and reaches the reward functions by name.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from datasets import Dataset

from grpokit.data import CONVERSATIONAL_COLUMN
from grpokit.data.columns import ACCEPTED, Layout, find_layout
from grpokit.errors import DataError

ROLE_NAMES = {
    "human": "user",
    "gpt": "assistant",
    "bot": "assistant",
    "observation": "tool",
    "observations": "tool",
    "function_response": "tool",
    "tool_response": "tool",
}
ROLES = ("system", "user", "assistant", "tool")  # what the chat templates render (after the aliases above)
_SHAREGPT_USER = ("user", "human")
_SHAREGPT_ASSISTANT = ("assistant", "gpt", "bot")


def _literal(value: Any, what: str) -> Any:
    """A list/dict stored as text (JSON, or a Python literal as in some ms-swift datasets) → the object."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise DataError(f"{what}: a string that is neither JSON nor a Python literal: {value[:80]!r}") from None


def _standard_message(m: Any, where: str) -> dict:
    """role/from and content/value keys; ms-swift's role aliases (human, gpt, observation, …)."""
    if not isinstance(m, dict):
        raise DataError(f"{where}: each message must be an object with role and content, got {type(m).__name__}")
    out = {k: v for k, v in m.items() if k not in ("from", "value")}
    # Arrow gives every message the keys of all of them (None where absent): read a key only when it is set
    role = m["role"] if m.get("role") is not None else m.get("from")
    content = m["content"] if m.get("content") is not None else m.get("value")
    if not isinstance(role, str):
        raise DataError(
            f"{where}: a message has no role (keys: {', '.join(map(str, m))}); use role/content or ShareGPT from/value"
        )
    if content is None and not m.get("tool_calls"):
        raise DataError(f"{where}: a {role!r} message has no content; fill it (an empty string is allowed)")
    out["content"] = content
    role = ROLE_NAMES.get(role, role)
    if role in ("tool_call", "function_call"):
        raise DataError(
            f"{where}: role {role!r} (ms-swift's tool-call message) is not supported in a prompt; "
            "put the call in an assistant message's tool_calls"
        )
    if role not in ROLES:
        raise DataError(
            f"{where}: unknown role {role!r}; use one of {', '.join(ROLES)} (or ms-swift's aliases "
            f"{', '.join(ROLE_NAMES)})"
        )
    out["role"] = role
    return out


def _sharegpt_pairs(turns: list[dict], where: str) -> list[dict]:
    """ShareGPT pairs ``[{"human": q, "assistant": r}, …]`` → alternating user/assistant messages."""
    out = []
    for turn in turns:
        user = next((turn[k] for k in _SHAREGPT_USER if k in turn), None)
        reply = next((turn[k] for k in _SHAREGPT_ASSISTANT if k in turn), None)
        if user is None:
            raise DataError(f"{where}: a ShareGPT turn has no human/user text (keys: {', '.join(turn)})")
        out.append({"role": "user", "content": user})
        if reply is not None:
            out.append({"role": "assistant", "content": reply})
    return out


def _messages(value: Any, where: str) -> list[dict]:
    value = _literal(value, where)
    if not isinstance(value, list) or not value:
        raise DataError(f"{where} must be a non-empty list of messages, got {type(value).__name__}")
    first = value[0]
    if isinstance(first, dict) and not ({"role", "content", "from", "value"} & set(first)):
        return _sharegpt_pairs(value, where)
    return [_standard_message(m, where) for m in value]


def _history(value: Any, where: str) -> list[dict]:
    """ms-swift's ``history``: ``[[query, response], …]`` before the row's query."""
    pairs = _literal(value, where) or []
    if not isinstance(pairs, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise DataError(f"{where} must be a list of [query, response] pairs")
    out: list[dict] = []
    for query, response in pairs:
        out += [{"role": "user", "content": query}, {"role": "assistant", "content": response}]
    return out


def _query(row: dict, lay: Layout, where: str) -> list[dict]:
    value = row[lay.query]
    if lay.alpaca_input is not None:
        parts = [p for p in (value, row[lay.alpaca_input]) if p]
        value = "\n".join(parts) if parts else None
    if isinstance(value, list):
        return [_standard_message(m, where) for m in value]
    if value is None or value == "":
        raise DataError(f"{where} has an empty prompt; fill its {lay.query!r} column")
    if not isinstance(value, str):
        raise DataError(
            f"{where}: column {lay.query!r} must be a string or a list of messages, got "
            f"{type(value).__name__}; accepted prompt columns: {ACCEPTED}"
        )
    return [{"role": "user", "content": value}]


def _row_messages(row: dict, lay: Layout, system: str | None, where: str) -> tuple[list[dict], str | None]:
    """The prompt messages of one row and its trailing assistant reply (None when it has none)."""
    if lay.messages is not None:
        if row[lay.messages] is None:
            raise DataError(f"{where}: column {lay.messages!r} is empty; fill it with a list of messages")
        messages = _messages(row[lay.messages], f"{where}: column {lay.messages!r}")
    else:
        messages = _query(row, lay, where)
    if lay.history is not None and row[lay.history]:
        messages = _history(row[lay.history], f"{where}: column {lay.history!r}") + messages
    reply = None
    if messages[-1]["role"] == "assistant":
        reply = messages.pop()["content"]
    if not [m for m in messages if m["role"] != "system"]:
        raise DataError(f"{where} has no prompt message before the assistant reply")
    default_system = (row[lay.system] if lay.system is not None else None) or system
    if default_system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": default_system})
    return messages, reply


def normalize_rows(
    ds: Dataset, system: str | None, *, source: str = "dataset", num_proc: int = 1, load_from_cache_file: bool = False
) -> Dataset:
    """Give every row a ``messages`` prompt; fill ``solution`` from the reference; add the system prompt.

    - the prompt comes from the first column of ``grpokit.data.columns``' lists that the dataset has: messages
      (also ShareGPT ``conversations`` with from/value and human/gpt roles), else prompt / query / question /
      problem / instruction(+input) / input, with ms-swift's ``history`` pairs before it; those columns are dropped.
    - a trailing assistant message is a reference reply, not part of the prompt: it is removed.
    - ``solution`` is kept; without it, it is filled from ``answer``, else ``response``/``output``/``completion``,
      else the trailing assistant reply (the source columns stay).
    - a row's own ``system``/``system_prompt`` column, else ``system``, is prepended when the row has no system
      message.
    - ``CONVERSATIONAL_COLUMN`` (hidden) records whether the prompt came as messages (a messages column, or a
      prompt column holding a list) or as a string: TRL's conversational or standard format.
    ``num_proc`` and ``load_from_cache_file`` are passed to ``Dataset.map`` (``--dataset_num_proc``,
    ``--load_from_cache_file``).
    """
    if len(ds) == 0:
        raise DataError(f"{source} has no rows; check the file or pick another dataset")
    lay = find_layout(list(ds.column_names), source)
    has_solution = "solution" in ds.column_names

    def convert(row: dict, index: int) -> dict:
        messages, reply = _row_messages(row, lay, system, f"{source}: row {index}")
        # TRL's rule (trl.data_utils.is_conversational): a prompt given as messages is conversational
        conversational = lay.messages is not None or isinstance(row[lay.query], list)
        out: dict = {"messages": messages, CONVERSATIONAL_COLUMN: conversational}
        if not has_solution:
            given = row[lay.reply] if lay.reply is not None else None
            out["solution"] = given if given is not None else reply
        return out

    ds = ds.map(
        convert,
        with_indices=True,
        remove_columns=lay.consumed,
        desc=f"normalising {source}",
        num_proc=num_proc if num_proc > 1 and len(ds) > 1 else None,
        load_from_cache_file=load_from_cache_file,
    )
    if not has_solution and all(value is None for value in ds["solution"]):
        ds = ds.remove_columns("solution")  # no answer and no reference reply anywhere: add no empty column
    return ds
