"""Structured outputs without a model: option parsing, grammar checks, bitmask unpacking, the logits processor."""

from __future__ import annotations

import json

import pytest
import torch

from grpokit.engines.grammar import GrammarLogitsProcessor, StructuredOutputs, allowed_from_bitmask
from grpokit.engines.structured import (
    Constraint,
    check_structured_options,
    constraint_from_config,
    constraint_of,
    load_json_schema,
)
from grpokit.errors import ConfigError
from grpokit.protocol import RequestConfig


@pytest.fixture(scope="module")
def tokenizer():
    from grpokit.testing import build_tiny_tokenizer

    return build_tiny_tokenizer()


def test_bitmask_bits_are_little_endian_per_byte():
    # byte 0 = 0b00000101 → tokens 0 and 2; byte 1 = 0b10000000 → token 8 + 7 = 15; vocab 18 > 16 bits: 16, 17 off
    packed = torch.tensor([[0b00000101, 0b10000000]], dtype=torch.uint8)
    allowed = allowed_from_bitmask(packed, vocab_size=18)
    assert allowed.shape == (1, 18)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, 15]
    assert allowed_from_bitmask(packed, vocab_size=3)[0].tolist() == [True, False, True]


def test_json_schema_from_dict_text_and_file(tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    assert load_json_schema(schema) == load_json_schema(json.dumps(schema)) == load_json_schema(str(path)) == schema
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_json_schema("{nope")
    with pytest.raises(ConfigError, match="no such file"):
        load_json_schema(str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="JSON object, got list"):
        load_json_schema("[1, 2]")


def test_one_constraint_at_most():
    assert constraint_of(None, None) is None
    assert constraint_of("[0-9]+", None) == Constraint("regex", "[0-9]+")
    # the schema is kept as canonical JSON text (sorted keys): equal schemas give equal (hashable) constraints
    assert constraint_of(None, {"b": 1, "type": "object"}) == constraint_of(None, '{"type": "object", "b": 1}')
    with pytest.raises(ConfigError, match="both set"):
        constraint_of("a", {"type": "object"})
    with pytest.raises(ConfigError, match="empty"):
        constraint_of("", None)
    cfg = RequestConfig(structured_outputs_json='{"type": "string"}')
    assert constraint_from_config(cfg) == Constraint("json", '{"type": "string"}')


@pytest.mark.parametrize(
    "regex, fragment",
    [
        ("[0-9", "unclosed character class"),
        (r"(a)\1", "backreferences are not supported"),
    ],
)
def test_invalid_regex_is_a_config_error_naming_the_option(regex, fragment):
    with pytest.raises(ConfigError, match=r"structured_outputs_regex .*" + fragment):
        check_structured_options(regex, None)


def test_invalid_schema_is_a_config_error_naming_the_option():
    with pytest.raises(ConfigError, match="structured_outputs_json .*objectx"):
        check_structured_options(None, '{"type": "objectx"}')
    assert check_structured_options(None, '{"type": "object"}').kind == "json"


def test_processor_masks_everything_outside_the_regex(tokenizer):
    # regex "7[0-9]": the first token must start with 7; after "7" only one digit; after "7x" only EOS
    factory = StructuredOutputs(tokenizer, tokenizer.eos_token_id, tokenizer.pad_token_id)
    procs = factory(RequestConfig(structured_outputs_regex="7[0-9]"), prompt_width=3)
    assert factory(RequestConfig(), prompt_width=3) is None  # no constraint: no processor
    proc = procs[0]
    vocab = len(tokenizer)
    prompt = torch.zeros((2, 3), dtype=torch.long)  # [B, W]
    scores = proc(prompt, torch.zeros((2, vocab)))  # [B, V]
    allowed = [tokenizer.decode([t]) for t in (scores[0] > float("-inf")).nonzero().flatten().tolist()]
    assert allowed and all(a in ("7",) or (len(a) == 2 and a[0] == "7" and a[1].isdigit()) for a in allowed)
    seven = tokenizer.convert_tokens_to_ids("7")
    step = torch.cat([prompt, torch.tensor([[seven], [seven]])], dim=1)
    scores = proc(step, torch.zeros((2, vocab)))
    allowed = {tokenizer.decode([t]) for t in (scores[0] > float("-inf")).nonzero().flatten().tolist()}
    assert allowed == set("0123456789")
    three = tokenizer.convert_tokens_to_ids("3")
    eos = tokenizer.eos_token_id
    step = torch.cat([step, torch.tensor([[three], [eos]])], dim=1)  # row 1 ended early: left untouched
    scores = proc(step, torch.zeros((2, vocab)))
    assert (scores[0] > float("-inf")).nonzero().flatten().tolist() == [eos]
    assert (scores[1] == 0).all()


def test_processor_refuses_a_token_outside_the_grammar(tokenizer):
    from grpokit.errors import RolloutError

    factory = StructuredOutputs(tokenizer, tokenizer.eos_token_id, tokenizer.pad_token_id)
    proc: GrammarLogitsProcessor = factory(RequestConfig(structured_outputs_regex="[0-9]+"), prompt_width=1)[0]
    proc(torch.zeros((1, 1), dtype=torch.long), torch.zeros((1, len(tokenizer))))
    letter = tokenizer.convert_tokens_to_ids("a")
    with pytest.raises(RolloutError, match="grammar refuses"):
        proc(torch.tensor([[0, letter]]), torch.zeros((1, len(tokenizer))))
