"""JSON text nobody vouches for is parsed within bounds wherever it is read: ``grpokit.wire.json_text.loads``
refuses what JSON is not (NaN, Infinity, a float out of range, a key twice, a lone surrogate escape), and the
parsers of model-written text (the TRL API's tool calls, OpenEnv actions, ToolBench's reward) answer deep or huge
JSON as text that did not parse, never with a RecursionError or ValueError escaping."""

from __future__ import annotations

import pytest

from grpokit.rewards.toolbench import _json
from grpokit.rollout.openenv_scheduler import OpenEnvScheduler
from grpokit.trl.tool_calls import parse_tool_calls
from grpokit.wire.json_text import JsonTextError, loads

DEEP = "[" * 100_000 + "]" * 100_000
HUGE_NUMBER = '{"x": ' + "7" * 10_000 + "}"


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"a": 1, "b": {"c": 2, "c": 3}}', "key 'c' appears twice"),
        ("[1, NaN]", "NaN is no JSON number"),
        ('{"t": -Infinity}', "-Infinity is no JSON number"),
        ("[1e400]", "out of a float's range"),
        ('{"s": "ok \\udfff"}', "lone UTF-16 surrogate"),
        ('["\\ud800x"]', "lone UTF-16 surrogate"),
        (DEEP, "nests deeper than 64"),
        (HUGE_NUMBER, "a number of 10000 characters"),
        (b'{"a": "\xc3"}', "not UTF-8"),
    ],
)
def test_loads_refuses_what_json_is_not(text, words):
    with pytest.raises(JsonTextError, match=words):
        loads(text)


def test_loads_takes_valid_pairs_and_logged_constants_where_asked():
    assert loads('"\\ud83d\\ude00 \\\\ud800"') == "\U0001f600 \\ud800"  # a pair, and an escaped backslash
    assert str(loads("[NaN, Infinity, 1e400]", finite=False)) == "[nan, inf, inf]"
    assert loads('["\\ud800"]', surrogates=False) == ["\ud800"]


@pytest.mark.parametrize(
    "block",
    [DEEP, HUGE_NUMBER, '{"name": "f", "name": "g"}', '{"name": "f", "arguments": "' + "[" * 5000 + '"}'],
)
def test_model_written_json_is_text_that_did_not_parse(block):
    calls = parse_tool_calls(f"<tool_call>{block}</tool_call>")
    assert len(calls) == 1 and (calls[0]["name"] is None or "__unparsed__" in calls[0]["arguments"])


@pytest.mark.parametrize("text", ['{"a": ' + DEEP + "}", HUGE_NUMBER, '{"a": 1, "a": 2}'])
def test_actions_and_rewards_read_model_json_within_bounds(text):
    assert OpenEnvScheduler.parse_action(None, text) == text  # not an action's fields: the text itself
    assert _json(text) == (False, text)
