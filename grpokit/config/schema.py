"""``--structured_outputs_json``'s value as a schema: a dict, JSON text, or the path of a ``.json`` file.

Reading the file is the option's business, so it lives with the options (``resolve`` turns a path into the
schema's text before a run starts, since a rollout server may not have the file); the engines parse a request's
schema text with ``parse_schema_text`` and compile it (``grpokit.engines.structured``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpokit.errors import ConfigError
from grpokit.protocol import MAX_JSON_DEPTH
from grpokit.wire.json_text import JsonTextError, loads


def load_json_schema(value: dict | str) -> dict[str, Any]:
    """A JSON schema from a dict, JSON text, or the path of a ``.json`` file; ConfigError if it is none of these."""
    if isinstance(value, dict):
        return value
    text = value.strip()
    if not text.startswith(("{", "[")) and Path(text).is_file():
        try:
            text = Path(text).read_text()
        except OSError as e:
            raise ConfigError(f"structured_outputs_json {value}: cannot read the file ({e.strerror})") from e
    elif not text.startswith(("{", "[")) and text.endswith(".json"):
        raise ConfigError(
            f"structured_outputs_json {value}: no such file; pass a JSON schema as JSON text or "
            "the path of a .json file"
        )
    schema = parse_schema_text(text)
    if not isinstance(schema, dict):
        raise ConfigError(f"structured_outputs_json: a JSON schema is a JSON object, got {type(schema).__name__}")
    return schema


def parse_schema_text(text: str) -> Any:
    """``json.loads`` of a schema's text within grpokit.wire.json_text's bounds (nesting ``MAX_JSON_DEPTH``, as
    schemas given as objects; number length): a ConfigError naming the bound or where the JSON fails, never
    Python's RecursionError or its integer-size ValueError."""
    try:
        return loads(text, max_depth=MAX_JSON_DEPTH, what="structured_outputs_json")
    except JsonTextError as e:
        raise ConfigError(f"{e}; pass a JSON schema as JSON text or the path of a .json file") from None
