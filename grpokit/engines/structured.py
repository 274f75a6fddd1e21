"""Structured outputs: completions constrained to a regex or to JSON valid against a schema, on every engine.

One grammar library serves all engines: llguidance (Rust, no dependencies, a token-bitmask API). The transformers
engine applies its bitmask in a Hugging Face ``LogitsProcessor``; the vLLM engine hands the same regex/schema to
vLLM's structured-outputs API with the ``guidance`` backend (llguidance inside vLLM), so a constraint means the same
thing on both. Regexes use Rust ``regex`` syntax (no look-around, no back-references); JSON is compact (no free
whitespace between tokens), as with vLLM's ``disable_any_whitespace``.

A constraint is checked before any sampling: an invalid regex or schema raises ``ConfigError`` (``grpokit train``
fails at start-up; the rollout server answers 400). A schema is read from a file only by ``load_json_schema``
(``grpokit.config.schema``), which ``grpokit train`` calls on its own option; a request carries the schema itself,
and errors never repeat it.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import torch

from grpokit.config.schema import load_json_schema as load_json_schema  # reading the option's file is config's
from grpokit.config.schema import parse_schema_text
from grpokit.errors import ConfigError, RolloutError

logger = logging.getLogger(__name__)

# JSON compiled without free whitespace: a model cannot pad a completion with blanks until max_tokens runs out.
JSON_OPTIONS = {"whitespace_flexible": False}
GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept per engine
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
        raise ConfigError("structured_outputs_regex and structured_outputs_json are both set; a completion can "
                          "follow one constraint: keep one of them")
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
        raise ConfigError("structured_outputs_json: a request carries the JSON schema itself, as a JSON object or "
                          "JSON text; a file path is read only from grpokit train's --structured_outputs_json")
    schema = parse_schema_text(value)
    if not isinstance(schema, dict):
        raise ConfigError(f"structured_outputs_json: a JSON schema is a JSON object, got {type(schema).__name__}")
    return schema


def constraint_from_config(config) -> Constraint | None:
    """The constraint of a ``RequestConfig``, or None when it asks for none."""
    return constraint_of(config.structured_outputs_regex, config.structured_outputs_json)


def _first_error_line(message: str) -> str:
    """The informative line of an llguidance error (its 'error: …' line, else the first line)."""
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("error:"):
            return ln.removeprefix("error:").strip()
    return lines[0] if lines else "invalid"


def _llguidance():
    try:
        import llguidance
    except ImportError as e:
        raise ConfigError("structured outputs need the llguidance package; pip install llguidance") from e
    return llguidance


def request_limits():
    """llguidance limits for constraints that come in requests (the rollout server): a fifth of the default lexer
    fuel and states. A pattern such as ``x{1000}{1000}`` then fails within about 50 MB and 0.4 s instead of 250 MB
    and 5 s (measured on the tiny test tokenizer); ordinary regexes and schemas use a tiny part of either."""
    llg = _llguidance()
    default = llg.LLParserLimits()
    return llg.LLParserLimits(initial_lexer_fuel=default.initial_lexer_fuel // 5,
                              step_lexer_fuel=default.step_lexer_fuel // 5,
                              max_lexer_states=default.max_lexer_states // 5)


def check_constraint(constraint: Constraint, lltokenizer=None, limits=None) -> None:
    """Compile the constraint's grammar; ConfigError naming the option and the problem if it is invalid."""
    llg = _llguidance()
    try:
        grammar = constraint.grammar()
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{constraint.option}: {_first_error_line(str(e))}") from e
    problem = llg.LLMatcher.validate_grammar(grammar, lltokenizer, limits=limits)
    if problem and not problem.startswith("WARNING"):
        hint = ("Rust regex syntax: no look-around or back-references" if constraint.kind == "regex"
                else "a JSON schema (draft 2020-12 subset that llguidance supports)")
        raise ConfigError(f"{constraint.option} {constraint.shown}: {_first_error_line(problem)}; expected {hint}")
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


def allowed_from_bitmask(bitmask_BW: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool mask [B, vocab_size] from packed bits [B, W] (uint8, little-endian: bit j of byte k is token 8k+j).

    Tokens past the bitmask (a model vocabulary padded beyond the tokenizer's) are not allowed.
    """
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask_BW.device)
    bits = ((bitmask_BW.unsqueeze(-1) >> shifts) & 1).reshape(bitmask_BW.shape[0], -1).bool()  # [B, 8W]
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    pad = torch.zeros(bits.shape[0], vocab_size - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


class GrammarLogitsProcessor:
    """A Hugging Face logits processor: each row's next token must keep its completion inside the grammar.

    One llguidance matcher per row consumes the row's last sampled token, then the row's bitmask sets every
    disallowed logit to -inf. A row that produced EOS (or padding after a stop string) is left alone.
    Runs before temperature, top-k and top-p (generate() puts custom processors first), so the processed
    logprobs are those of the constrained distribution.

    A row whose matcher fails (the grammar engine's limits, or no continuation at all) is ended with EOS and its
    message kept in ``failed`` (row → one line); the other rows go on. The rollout server answers the request
    of a failed row with a 400 (server/engine.py); ``batch`` is the number of rows seen.
    """

    def __init__(self, lltokenizer, grammar: str, prompt_width: int, end_ids: set[int], eos_token_id: int,
                 constraint: Constraint | None = None, limits=None) -> None:
        llg = _llguidance()
        self._llg = llg
        self._root = llg.LLMatcher(lltokenizer, grammar, log_level=0, limits=limits)
        if self._root.is_error():
            raise ConfigError(f"structured outputs: {_first_error_line(self._root.get_error())}")
        self.prompt_width = prompt_width
        self.end_ids = end_ids
        self.eos_token_id = eos_token_id
        self.constraint = constraint
        self.matchers: list = []
        self.done: list[bool] = []
        self.failed: dict[int, str] = {}
        self._masks: dict[int, bytes] = {}  # each row's last bitmask: was its sampled token allowed?

    @property
    def batch(self) -> int:
        return len(self.matchers)

    def __call__(self, input_ids_BL: torch.LongTensor, scores_BV: torch.FloatTensor) -> torch.FloatTensor:
        batch = scores_BV.shape[0]
        ended: list[int] = []  # rows failed at this step: EOS is their only token
        if not self.matchers:
            self.matchers = [self._root.deep_copy() for _ in range(batch)]
            self.done = [False] * batch
        elif input_ids_BL.shape[1] > self.prompt_width:
            last = input_ids_BL[:, -1].tolist()
            for row, token in enumerate(last):
                if not self._consume(row, token):
                    ended.append(row)
        rows, masks = [], []
        for r in range(batch):
            if self.done[r]:
                continue
            mask = self._bitmask(r)
            if mask is None:
                ended.append(r)
            else:
                rows.append(r)
                masks.append(mask)
        if ended:
            eos_only = torch.full_like(scores_BV[ended], float("-inf"))
            eos_only[:, self.eos_token_id] = 0.0
            scores_BV = scores_BV.index_copy(0, torch.tensor(ended, device=scores_BV.device), eos_only)
        if not rows:
            return scores_BV
        packed = torch.stack([torch.frombuffer(bytearray(m), dtype=torch.uint8) for m in masks])  # [R, W]
        allowed_RV = allowed_from_bitmask(packed, scores_BV.shape[1]).to(scores_BV.device)
        dead = ~allowed_RV.any(dim=1)  # the grammar allows no token here (e.g. the model's vocabulary cannot
        if bool(dead.any()):  # spell what it needs): end the row instead of sampling from nothing (NaN)
            allowed_RV[dead, self.eos_token_id] = True
        index = torch.tensor(rows, device=scores_BV.device)
        sub = scores_BV.index_select(0, index).masked_fill(~allowed_RV, float("-inf"))
        return scores_BV.index_copy(0, index, sub)

    def _fail(self, row: int, message: str) -> None:
        if not self.failed:
            logger.warning("structured outputs: row %d ended early: %s", row, message)
        self.failed[row] = message
        self.done[row] = True

    def _bitmask(self, row: int) -> bytes | None:
        m = self.matchers[row]
        try:
            mask = m.compute_bitmask()
        except Exception as e:  # noqa: BLE001 - llguidance may raise instead of flagging the matcher
            self._fail(row, row_error(self.constraint, str(e), "mask"))
            return None
        if m.is_error():
            self._fail(row, row_error(self.constraint, m.get_error(), "mask"))
            return None
        self._masks[row] = mask
        return mask

    def _consume(self, row: int, token: int) -> bool:
        """Advance the row's matcher by its sampled token; False (the row failed) when the matcher refuses it."""
        if self.done[row]:
            return True
        m = self.matchers[row]
        if token in self.end_ids:
            self.done[row] = True
            return True
        try:
            consumed = m.consume_token(token)
        except Exception as e:  # noqa: BLE001 - llguidance may raise instead of flagging the matcher
            self._fail(row, row_error(self.constraint, str(e), "token"))
            return False
        if not consumed:
            mask = self._masks.get(row, b"")
            if token // 8 >= len(mask) or not (mask[token // 8] >> (token % 8)) & 1:  # not from the grammar's mask:
                raise RolloutError(f"structured outputs: the sampler picked token {token}, which the grammar "
                                   f"refuses ({_first_error_line(m.get_error())})")  # a bug, not the request's
            self._fail(row, row_error(self.constraint, m.get_error(), "token"))  # the engine's own limits
            return False
        return True


def row_error(constraint: Constraint | None, error: str, stage: str) -> str:
    """One line for a matcher that failed: at a mask (``stage`` "mask": nothing can follow, or a limit) or on a
    token (the grammar engine's limits: the sampled token came from its own mask)."""
    name = f"{constraint.option} {constraint.shown}" if constraint is not None else "structured outputs"
    detail = _first_error_line(error or "stopped")
    if stage == "mask":
        return (f"{name}: the grammar allows no continuation here (llguidance: {detail}); check that the regex or "
                "schema matches text this model's tokens can spell, within the grammar engine's limits")
    return (f"{name}: the grammar engine cannot follow it (llguidance: {detail}); use a smaller pattern or schema "
            "(fewer nested repetitions)")


class StructuredOutputs:
    """The transformers engine's ``logits_processor_factory``: ``factory(config, prompt_width)`` gives a
    ``LogitsProcessorList`` holding a ``GrammarLogitsProcessor`` when ``config`` carries a constraint, else None."""

    def __init__(self, tokenizer, eos_token_id: int, pad_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.end_ids = {eos_token_id} | ({pad_token_id} if pad_token_id is not None else set())
        self.eos_token_id = eos_token_id
        self._lltokenizer = None
        self._checked: OrderedDict[Constraint, str] = OrderedDict()  # constraint → compiled grammar (the latest few)
        self.limits = None  # llguidance's limits (None: its defaults); the rollout server sets request_limits()

    @property
    def lltokenizer(self):
        if self._lltokenizer is None:
            _llguidance()
            import llguidance.hf

            try:
                self._lltokenizer = llguidance.hf.from_tokenizer(self.tokenizer, eos_token=self.eos_token_id)
            except ValueError as e:
                raise ConfigError(f"structured outputs need a fast tokenizer (tokenizer.json): {e}") from e
        return self._lltokenizer

    def grammar_for(self, constraint: Constraint) -> str:
        """The checked grammar of ``constraint`` (compiled and validated once per constraint)."""
        grammar = self._checked.get(constraint)
        if grammar is None:
            check_constraint(constraint, self.lltokenizer, self.limits)
            grammar = self._checked[constraint] = constraint.grammar()
            while len(self._checked) > GRAMMAR_CACHE_SIZE:  # requests may each carry a new one: keep memory bounded
                self._checked.popitem(last=False)
        else:
            self._checked.move_to_end(constraint)
        return grammar

    def __call__(self, config, prompt_width: int):
        constraint = constraint_from_config(config)
        if constraint is None:
            return None
        from transformers import LogitsProcessorList

        grammar = self.grammar_for(constraint)
        return LogitsProcessorList([GrammarLogitsProcessor(self.lltokenizer, grammar, prompt_width, self.end_ids,
                                                           self.eos_token_id, constraint, self.limits)])
