"""Column names: ``--columns`` remapping and the column aliases of ms-swift's dataset preprocessors.

``--columns`` takes a JSON object (or the path of a JSON file holding one), ``{"source": "destination"}``, as in
ms-swift. It is applied first, to every dataset, before the aliases below are looked up; a source column is matched
ignoring case. The aliases (``conversations`` for ``messages``, ``question``/``problem`` for the prompt, …) are
found by ``find_layout``; which column plays which part is decided once per dataset, not per row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from datasets import Dataset

from grpokit.errors import ConfigError, DataError

# the order is the priority when a dataset has several of them
MESSAGES_COLUMNS = ("messages", "conversation", "conversations")
QUERY_COLUMNS = ("prompt", "query", "question", "problem", "instruction", "input")
SYSTEM_COLUMNS = ("system", "system_prompt")
REPLY_COLUMNS = ("response", "output", "completion")  # a reference reply: becomes `solution` when there is none
ACCEPTED = (
    "messages/conversation(s) (list of messages, ShareGPT from/value too), prompt (str or messages), "
    "query, question, problem, instruction (+ input), input"
)


def parse_columns(value: str | dict | None) -> dict[str, str]:
    """``--columns`` as a dict: a JSON object, or the path of a JSON file holding one (ms-swift's forms)."""
    if value is None or value == "" or value == {}:
        return {}
    if isinstance(value, dict):
        mapping = value
    else:
        text = value
        if Path(value).expanduser().is_file():
            text = Path(value).expanduser().read_text(encoding="utf-8")
        try:
            mapping = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"--columns {value!r}: not a JSON object or a JSON file ({exc.msg}); use e.g. "
                '--columns \'{"question": "query", "final_answer": "solution"}\''
            ) from None
    if not isinstance(mapping, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and v for k, v in mapping.items()
    ):
        raise ConfigError(
            f'--columns {value!r}: must map column names to column names, e.g. \'{{"question": "query"}}\''
        )
    if len(set(mapping.values())) != len(mapping):
        raise ConfigError(f"--columns {value!r}: two columns are mapped to the same name; map each to its own")
    return dict(mapping)


def rename_columns(ds: Dataset, mapping: dict[str, str], source: str) -> tuple[Dataset, set[str]]:
    """Apply ``--columns`` to one dataset; returns it and the mapping keys it used (matched ignoring case)."""
    by_lower = {c.lower(): c for c in ds.column_names}
    renames = {by_lower[k.lower()]: v for k, v in mapping.items() if k.lower() in by_lower}
    renames = {k: v for k, v in renames.items() if k != v}
    for old, new in renames.items():
        if new in ds.column_names and new not in renames:
            raise DataError(
                f"{source}: --columns maps {old!r} to {new!r}, but the dataset already has a column "
                f"{new!r}; map {new!r} elsewhere too, or pick another name"
            )
    used = {k for k in mapping if k.lower() in by_lower}
    return (ds.rename_columns(renames) if renames else ds), used


@dataclass
class Layout:
    """Which column plays which part in one dataset (actual column names)."""

    messages: str | None = None  # a list of messages (or ShareGPT turns)
    query: str | None = None  # a string (or, for `prompt`, a list of messages)
    alpaca_input: str | None = None  # with query == instruction: the `input` appended to it
    system: str | None = None
    history: str | None = None
    reply: str | None = None  # reference reply column (solution, answer or response/output/completion)
    consumed: list[str] = field(default_factory=list)  # columns whose content now lives in `messages`


def _first(lower: dict[str, str], names: tuple[str, ...]) -> str | None:
    return next((lower[n] for n in names if n in lower), None)


def find_layout(columns: list[str], source: str) -> Layout:
    """Decide the prompt/system/history/reply columns of a dataset; DataError when it has no prompt column."""
    lower = {c.lower(): c for c in columns}
    out = Layout(messages=_first(lower, MESSAGES_COLUMNS))
    if out.messages is None:
        if "instruction" in lower and "input" in lower:  # alpaca: instruction + "\n" + input
            out.query, out.alpaca_input = lower["instruction"], lower["input"]
        else:
            out.query = _first(lower, QUERY_COLUMNS)
        if out.query is None:
            raise DataError(
                f"{source}: no prompt column (columns: {', '.join(columns) or 'none'}); add one of: "
                f'{ACCEPTED}, or rename yours with --columns \'{{"your_column": "query"}}\''
            )
    out.system = _first(lower, SYSTEM_COLUMNS)
    out.history = lower.get("history")
    out.reply = _first(lower, ("solution", "answer") + REPLY_COLUMNS)
    prompt = [out.messages or out.query, out.alpaca_input, out.system, out.history]
    out.consumed = [c for c in prompt if c is not None and c != "messages"]
    return out
