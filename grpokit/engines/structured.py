"""Structured outputs: completions constrained to a regex or to JSON valid against a schema, on every engine.

One grammar library serves all engines: llguidance (Rust, no dependencies, a token-bitmask API). The transformers
engine applies its bitmask in a Hugging Face ``LogitsProcessor``; the vLLM engine hands the same regex/schema to
vLLM's structured-outputs API with the ``guidance`` backend (llguidance inside vLLM), so a constraint means the same
thing on both. Regexes use Rust ``regex`` syntax (no look-around, no back-references); JSON is compact (no free
whitespace between tokens), as with vLLM's ``disable_any_whitespace``.

This module holds the constraints and their checks; grammar.py applies one while the transformers engine samples.

A constraint is checked before any sampling: an invalid regex or schema raises ``ConfigError`` (``grpokit train``
fails at start-up; the rollout server answers 400). A schema is read from a file only by ``load_json_schema``
(``grpokit.config.schema``), which ``grpokit train`` calls on its own option; a request carries the schema itself,
and errors never repeat it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from grpokit.config.schema import load_json_schema as load_json_schema  # reading the option's file is config's
from grpokit.config.schema import parse_schema_text
from grpokit.errors import ConfigError

logger = logging.getLogger(__name__)

# JSON compiled without free whitespace: a model cannot pad a completion with blanks until max_tokens runs out.
JSON_OPTIONS = {"whitespace_flexible": False}
PROBE_TOKENS = 4  # tokens the up-front check walks through the grammar (llguidance builds its lexer lazily)


@dataclass(frozen=True)
class Constraint:
    """What a completion must be: ``kind`` regex (``text`` is the pattern) or json (``text`` is the schema)."""

    kind: Literal["regex", "json"]
    text: str

    @property
    def option(self) -> str:
        return "structured_outputs_regex" if self.kind == "regex" else "structured_outputs_json"

    @property
    def shown(self) -> str:
        """How errors name it: a regex shortened; a schema is not repeated back."""
        if self.kind == "json":
            return "schema"
        return repr(self.text if len(self.text) <= 80 else self.text[:77] + "...")

    def grammar(self) -> str:
        """The llguidance grammar of this constraint."""
        from llguidance import LLMatcher

        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.text)
        return LLMatcher.grammar_from_json_schema(self.text, overrides=JSON_OPTIONS)

    def schema(self) -> dict[str, Any]:
        """The JSON schema (json constraints only)."""
        return json.loads(self.text)


def constraint_of(regex: str | None, schema: dict | str | None) -> Constraint | None:
    """The constraint given by the two options (at most one may be set), or None; not yet compiled."""
    if regex is not None and schema is not None:
        raise ConfigError(
            "structured_outputs_regex and structured_outputs_json are both set; a completion can "
            "follow one constraint: keep one of them"
        )
    if regex is not None:
        if not regex:
            raise ConfigError("structured_outputs_regex is empty; pass a pattern or leave the option unset")
        return Constraint("regex", regex)
    if schema is not None:
        return Constraint("json", json.dumps(_schema_object(schema), sort_keys=True))
    return None


def _schema_object(value: dict | str) -> dict[str, Any]:
    """A schema given in a request: a dict or JSON text, never a path (the server does not read its own files)."""
    if isinstance(value, dict):
        return value
    if not value.lstrip().startswith("{"):
        raise ConfigError(
            "structured_outputs_json: a request carries the JSON schema itself, as a JSON object or "
            "JSON text; a file path is read only from grpokit train's --structured_outputs_json"
        )
    schema = parse_schema_text(value)
    if not isinstance(schema, dict):
        raise ConfigError(f"structured_outputs_json: a JSON schema is a JSON object, got {type(schema).__name__}")
    return schema


def constraint_from_config(config) -> Constraint | None:
    """The constraint of a ``RequestConfig``, or None when it asks for none."""
    return constraint_of(config.structured_outputs_regex, config.structured_outputs_json)


def first_error_line(message: str) -> str:
    """The informative line of an llguidance error (its 'error: …' line, else the first line)."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("error:"):
            return ln.removeprefix("error:").strip()
    return lines[0] if lines else "invalid"


def llguidance_module():
    try:
        import llguidance
    except ImportError as e:
        raise ConfigError("structured outputs need the llguidance package; pip install llguidance") from e
    return llguidance


def request_limits():
    """llguidance limits for constraints that come in requests (the rollout server): a fifth of the default lexer
    fuel and states. A pattern such as ``x{1000}{1000}`` then fails within about 50 MB and 0.4 s instead of 250 MB
    and 5 s (measured on the tiny test tokenizer); ordinary regexes and schemas use a tiny part of either."""
    llg = llguidance_module()
    default = llg.LLParserLimits()
    return llg.LLParserLimits(
        initial_lexer_fuel=default.initial_lexer_fuel // 5,
        step_lexer_fuel=default.step_lexer_fuel // 5,
        max_lexer_states=default.max_lexer_states // 5,
    )


def check_constraint(constraint: Constraint, lltokenizer=None, limits=None) -> None:
    """Compile the constraint's grammar; ConfigError naming the option and the problem if it is invalid."""
    llg = llguidance_module()
    try:
        grammar = constraint.grammar()
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{constraint.option}: {first_error_line(str(e))}") from e
    problem = llg.LLMatcher.validate_grammar(grammar, lltokenizer, limits=limits)
    if problem and not problem.startswith("WARNING"):
        hint = (
            "Rust regex syntax: no look-around or back-references"
            if constraint.kind == "regex"
            else "a JSON schema (draft 2020-12 subset that llguidance supports)"
        )
        raise ConfigError(f"{constraint.option} {constraint.shown}: {first_error_line(problem)}; expected {hint}")
    if lltokenizer is not None:
        _probe(llg, lltokenizer, grammar, constraint, limits)


def _probe(llg, lltokenizer, grammar: str, constraint: Constraint, limits=None) -> None:
    """Walk the first ``PROBE_TOKENS`` tokens the grammar allows: llguidance builds its lexer lazily, so a pattern
    such as ``x{1000}{1000}`` passes validation and hits the engine's size limits only on the first token."""
    m = llg.LLMatcher(lltokenizer, grammar, log_level=0, limits=limits)
    for _ in range(PROBE_TOKENS):
        try:
            mask = None if m.is_error() else m.compute_bitmask()
        except Exception as e:  # noqa: BLE001 - llguidance may raise instead of flagging the matcher
            raise ConfigError(row_error(constraint, str(e), "mask")) from None
        if m.is_error():
            raise ConfigError(row_error(constraint, m.get_error(), "mask"))
        token = _first_allowed(mask, lltokenizer.eos_token)
        if token is None or m.is_stopped():
            return
        try:
            consumed = m.consume_token(token)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(row_error(constraint, str(e), "token")) from None
        if not consumed:
            raise ConfigError(row_error(constraint, m.get_error(), "token"))


def _first_allowed(mask: bytes, eos: int) -> int | None:
    """The lowest token id set in an llguidance bitmask (little-endian bits), other than ``eos``; None if none."""
    bits = int.from_bytes(mask, "little") & ~(1 << eos)
    return (bits & -bits).bit_length() - 1 if bits else None


def check_structured_options(regex: str | None, schema: dict | str | None) -> Constraint | None:
    """Start-up check of ``--structured_outputs_regex`` / ``--structured_outputs_json`` (no tokenizer needed)."""
    constraint = constraint_of(regex, schema)
    if constraint is not None:
        check_constraint(constraint)
    return constraint


def row_error(constraint: Constraint | None, error: str, stage: str) -> str:
    """One line for a matcher that failed: at a mask (``stage`` "mask": nothing can follow, or a limit) or on a
    token (the grammar engine's limits: the sampled token came from its own mask)."""
    name = f"{constraint.option} {constraint.shown}" if constraint is not None else "structured outputs"
    detail = first_error_line(error or "stopped")
    if stage == "mask":
        return (
            f"{name}: the grammar allows no continuation here (llguidance: {detail}); check that the regex or "
            "schema matches text this model's tokens can spell, within the grammar engine's limits"
        )
    return (
        f"{name}: the grammar engine cannot follow it (llguidance: {detail}); use a smaller pattern or schema "
        "(fewer nested repetitions)"
    )
