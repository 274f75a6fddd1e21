"""--max_length without tokenizing every prompt before step 1.

A prompt's token count has a cheap upper bound: the tokens the chat template adds around its messages (measured
once per sequence of roles, by rendering those roles with empty contents) plus the UTF-8 bytes of the contents (a
byte-level BPE or SentencePiece token covers at least one byte), plus a few tokens of slack per message for merges
across the template's text and the content's. A row whose bound is within ``--max_length`` is within it; only the
rows above the bound, usually few or none, are rendered and tokenized to get their exact length. Rows this cannot
bound (contents that are not text, tools or chat-template kwargs carried on a message, tool calls) are tokenized
too. The column is read in batches, so memory does not grow with the dataset either.
"""

from __future__ import annotations

SLACK_TOKENS = 8  # a BOS-like token or a SentencePiece dummy prefix the template's text may gain
SLACK_PER_MESSAGE = 4  # merges across the template text around a content and the content itself
BATCH_ROWS = 1024
TOKENIZE_ROWS = 256  # rows per tokenizer call


def lengths_over_bound(ds, template, limit: int) -> dict[int, int]:
    """The exact prompt length (tokens) of every row whose cheap bound exceeds ``limit``; every row missing from
    the answer is certainly within ``limit``."""
    overheads: dict[tuple[str, ...], int | None] = {}
    unsure: list[int] = []
    start = 0
    for batch in ds.select_columns(["messages"]).iter(batch_size=BATCH_ROWS):
        rows = batch["messages"]
        for k, messages in enumerate(rows):
            bound = _bound(messages, template, overheads)
            if bound is None or bound > limit:
                unsure.append(start + k)
        start += len(rows)
    lengths: dict[int, int] = {}
    for s in range(0, len(unsure), TOKENIZE_ROWS):
        indices = unsure[s : s + TOKENIZE_ROWS]
        lengths.update(zip(indices, template.prompt_lengths(ds.select(indices)["messages"]), strict=True))
    return lengths


def _bound(messages: list[dict], template, overheads: dict) -> int | None:
    """The row's upper bound in tokens, or None when it cannot be bounded cheaply."""
    roles, size = [], 0
    for m in messages:
        content = m.get("content")
        extra = [k for k, v in m.items() if k not in ("role", "content") and v is not None]
        if not isinstance(content, str) or extra or not isinstance(m.get("role"), str):
            return None
        roles.append(m["role"])
        size += len(content.encode("utf-8", "surrogatepass"))
    key = tuple(roles)
    if key not in overheads:
        try:
            overheads[key] = template.prompt_lengths([[{"role": r, "content": ""} for r in key]])[0]
        except Exception:  # noqa: BLE001 - a template that refuses empty contents: those rows are tokenized
            overheads[key] = None
    overhead = overheads[key]
    return None if overhead is None else overhead + size + SLACK_TOKENS + SLACK_PER_MESSAGE * len(key)
