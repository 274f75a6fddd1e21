"""Structured outputs: completions constrained to a regex or to JSON valid against a schema, on every engine.

One grammar library serves all engines: llguidance (Rust, no dependencies, a token-bitmask API). The transformers
engine applies its bitmask in a Hugging Face ``LogitsProcessor``; the vLLM engine hands the same regex/schema to
vLLM's structured-outputs API with the ``guidance`` backend (llguidance inside vLLM), so a constraint means the same
thing on both. Regexes use Rust ``regex`` syntax (no look-around, no back-references); JSON is compact (no free
whitespace between tokens), as with vLLM's ``disable_any_whitespace``.

A constraint is checked before any sampling: an invalid regex or schema raises ``ConfigError`` (``grpokit train``
fails at start-up; the rollout server answers 400). A schema is read from a file only by ``load_json_schema``, which
``grpokit train`` calls on its own option; a request carries the schema itself, and errors never repeat it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from grpokit.errors import ConfigError, RolloutError

# JSON compiled without free whitespace: a model cannot pad a completion with blanks until max_tokens runs out.
JSON_OPTIONS = {"whitespace_flexible": False}
GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept per engine


@dataclass(frozen=True)
class Constraint:
    """What a completion must be: ``kind`` regex (``text`` is the pattern) or json (``text`` is the schema)."""

    kind: Literal["regex", "json"]
    text: str

    @property
    def option(self) -> str:
        return "structured_outputs_regex" if self.kind == "regex" else "structured_outputs_json"

    def grammar(self) -> str:
        """The llguidance grammar of this constraint."""
        from llguidance import LLMatcher

        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.text)
        return LLMatcher.grammar_from_json_schema(self.text, overrides=JSON_OPTIONS)

    def schema(self) -> dict[str, Any]:
        """The JSON schema (json constraints only)."""
        return json.loads(self.text)


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
        raise ConfigError(f"structured_outputs_json {value}: no such file; pass a JSON schema as JSON text or "
                          "the path of a .json file")
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"structured_outputs_json: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                          "pass a JSON schema as JSON text or the path of a .json file") from e
    if not isinstance(schema, dict):
        raise ConfigError(f"structured_outputs_json: a JSON schema is a JSON object, got {type(schema).__name__}")
    return schema


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
    try:
        schema = json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(f"structured_outputs_json: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") \
            from e
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


def check_constraint(constraint: Constraint, lltokenizer=None) -> None:
    """Compile the constraint's grammar; ConfigError naming the option and the problem if it is invalid."""
    llg = _llguidance()
    try:
        grammar = constraint.grammar()
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{constraint.option}: {_first_error_line(str(e))}") from e
    problem = llg.LLMatcher.validate_grammar(grammar, lltokenizer)
    if problem and not problem.startswith("WARNING"):
        # a regex is shown (shortened); a schema is not repeated back
        shown = ("schema" if constraint.kind == "json" else
                 repr(constraint.text if len(constraint.text) <= 80 else constraint.text[:77] + "..."))
        hint = ("Rust regex syntax: no look-around or back-references" if constraint.kind == "regex"
                else "a JSON schema (draft 2020-12 subset that llguidance supports)")
        raise ConfigError(f"{constraint.option} {shown}: {_first_error_line(problem)}; expected {hint}")


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
    """

    def __init__(self, lltokenizer, grammar: str, prompt_width: int, end_ids: set[int], eos_token_id: int) -> None:
        llg = _llguidance()
        self._llg = llg
        self._root = llg.LLMatcher(lltokenizer, grammar, log_level=0)
        if self._root.is_error():
            raise ConfigError(f"structured outputs: {_first_error_line(self._root.get_error())}")
        self.prompt_width = prompt_width
        self.end_ids = end_ids
        self.eos_token_id = eos_token_id
        self.matchers: list = []
        self.done: list[bool] = []

    def __call__(self, input_ids_BL: torch.LongTensor, scores_BV: torch.FloatTensor) -> torch.FloatTensor:
        batch = scores_BV.shape[0]
        if not self.matchers:
            self.matchers = [self._root.deep_copy() for _ in range(batch)]
            self.done = [False] * batch
        elif input_ids_BL.shape[1] > self.prompt_width:
            last = input_ids_BL[:, -1].tolist()
            for row, token in enumerate(last):
                self._consume(row, token)
        rows = [r for r in range(batch) if not self.done[r]]
        if not rows:
            return scores_BV
        packed = torch.stack([torch.frombuffer(bytearray(self._bitmask(r)), dtype=torch.uint8)
                              for r in rows])  # [R, W]
        allowed_RV = allowed_from_bitmask(packed, scores_BV.shape[1]).to(scores_BV.device)
        dead = ~allowed_RV.any(dim=1)  # the grammar allows no token here (e.g. the model's vocabulary cannot
        if bool(dead.any()):  # spell what it needs): end the row instead of sampling from nothing (NaN)
            allowed_RV[dead, self.eos_token_id] = True
        index = torch.tensor(rows, device=scores_BV.device)
        sub = scores_BV.index_select(0, index).masked_fill(~allowed_RV, float("-inf"))
        return scores_BV.index_copy(0, index, sub)

    def _bitmask(self, row: int) -> bytes:
        m = self.matchers[row]
        mask = m.compute_bitmask()
        if m.is_error():
            raise ConfigError(f"structured outputs: the grammar allows no continuation here (llguidance: "
                              f"{_first_error_line(m.get_error())}); check that the regex or schema matches text "
                              "this model's tokens can spell")
        return mask

    def _consume(self, row: int, token: int) -> None:
        if self.done[row]:
            return
        m = self.matchers[row]
        if token in self.end_ids:
            self.done[row] = True
            return
        if not m.consume_token(token):
            raise RolloutError(f"structured outputs: the sampler picked token {token}, which the grammar refuses "
                               f"({_first_error_line(m.get_error())})")


class StructuredOutputs:
    """The transformers engine's ``logits_processor_factory``: ``factory(config, prompt_width)`` gives a
    ``LogitsProcessorList`` holding a ``GrammarLogitsProcessor`` when ``config`` carries a constraint, else None."""

    def __init__(self, tokenizer, eos_token_id: int, pad_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.end_ids = {eos_token_id} | ({pad_token_id} if pad_token_id is not None else set())
        self.eos_token_id = eos_token_id
        self._lltokenizer = None
        self._checked: OrderedDict[Constraint, str] = OrderedDict()  # constraint → compiled grammar (the latest few)

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
            check_constraint(constraint, self.lltokenizer)
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
                                                           self.eos_token_id)])
