"""ms-swift's dataset conventions: column aliases, ShareGPT, alpaca, history, --columns, --system FILE, map options."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from grpokit.data.columns import parse_columns
from grpokit.data.loading import RowOptions, load_train_val, normalize_rows, resolve_system
from grpokit.errors import ConfigError, DataError

USER_Q = [{"role": "user", "content": "What is 2+2?"}]


def rows_of(rows: list[dict], system: str | None = None, **kw) -> list[dict]:
    ds = normalize_rows(datasets.Dataset.from_list(rows), system, source="d.jsonl", **kw)
    return [ds[i] for i in range(len(ds))]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("column", ["question", "problem", "query", "prompt", "input", "Question"])
def test_prompt_column_aliases(column):
    [row] = rows_of([{column: "What is 2+2?", "solution": "4"}])
    assert row == {"messages": USER_Q, "solution": "4", "_conversational": False}  # a string: TRL's standard


def test_instruction_and_input_are_joined_as_alpaca_does():
    [row] = rows_of([{"instruction": "Add the numbers.", "input": "2 3", "output": "5"}])
    assert row["messages"] == [{"role": "user", "content": "Add the numbers.\n2 3"}]
    assert row["solution"] == "5" and row["output"] == "5"  # output stays; it also fills solution
    [row] = rows_of([{"instruction": "Say hi.", "input": ""}])
    assert row["messages"] == [{"role": "user", "content": "Say hi."}]


def test_sharegpt_conversations_with_from_value_and_system_column():
    conv = [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"}]
    [row] = rows_of([{"conversations": conv, "system": "Be terse."}])
    assert row["messages"] == [{"role": "system", "content": "Be terse."}, *USER_Q]
    assert row["solution"] == "4"  # the trailing reply is the reference
    assert "conversations" not in row and "system" not in row


def test_sharegpt_pairs_and_messages_as_json_text():
    [row] = rows_of([{"conversation": [{"human": "hi", "assistant": "hello"}, {"human": "What is 2+2?"}]}])
    assert row["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, *USER_Q]
    [row] = rows_of([{"messages": json.dumps(USER_Q)}])
    assert row["messages"] == USER_Q


def test_history_pairs_come_before_the_query_and_system_prompt_column():
    [row] = rows_of([{"query": "What is 2+2?", "history": [["hi", "hello"]], "system_prompt": "S"}])
    assert row["messages"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        *USER_Q,
    ]


def test_observation_role_becomes_tool_and_tool_call_role_is_refused():
    msgs = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "call"},
        {"role": "observation", "content": "42"},
    ]
    [row] = rows_of([{"messages": msgs}])
    assert row["messages"][-1] == {"role": "tool", "content": "42"}
    with pytest.raises(DataError, match="row 0.*'tool_call'.*not supported"):
        rows_of([{"messages": [{"role": "user", "content": "go"}, {"role": "tool_call", "content": "{}"}]}])


def test_response_column_fills_solution_and_answer_wins():
    assert rows_of([{"query": "q", "response": "r"}])[0]["solution"] == "r"
    assert rows_of([{"query": "q", "answer": "a", "response": "r"}])[0]["solution"] == "a"


def test_bad_messages_name_row_and_accepted_forms():
    with pytest.raises(DataError, match=r"d.jsonl: row 1: column 'messages' must be a non-empty list"):
        rows_of([{"messages": USER_Q}, {"messages": []}])
    with pytest.raises(DataError, match=r"row 0: column 'messages': a message has no role \(keys: text, role\)"):
        rows_of([{"messages": [{"text": "hi", "role": None}]}])


def test_columns_option_json_and_file(tmp_path):
    assert parse_columns('{"q_text": "query"}') == {"q_text": "query"}
    path = tmp_path / "cols.json"
    path.write_text('{"a": "b"}')
    assert parse_columns(str(path)) == {"a": "b"}
    with pytest.raises(ConfigError, match="--columns 'q_text:query': not a JSON object"):
        parse_columns("q_text:query")
    with pytest.raises(ConfigError, match="same name"):
        parse_columns('{"a": "query", "b": "query"}')


def test_columns_remap_before_aliases(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"Text1": "What is 2+2?", "final": "4", "question": "ignored?"}])
    opts = RowOptions(columns={"text1": "prompt", "final": "solution"})
    train, _ = load_train_val([data], [], system=None, seed=0, options=opts)
    # prompt outranks question among the aliases; the mapped source is matched ignoring case
    assert train[0]["messages"] == USER_Q and train[0]["solution"] == "4" and train[0]["question"] == "ignored?"


def test_columns_naming_no_column_and_clashing_target(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"query": "q", "solution": "4"}])
    with pytest.raises(ConfigError, match="--columns names 'nope', which no dataset has"):
        load_train_val([data], [], system=None, seed=0, options=RowOptions(columns={"nope": "query"}))
    with pytest.raises(DataError, match="maps 'query' to 'solution', but the dataset already has"):
        load_train_val([data], [], system=None, seed=0, options=RowOptions(columns={"query": "solution"}))


def test_system_txt_is_read_from_the_file_and_other_values_are_text(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("You are a careful solver.\nThink first.", encoding="utf-8")
    assert resolve_system(str(path)) == "You are a careful solver.\nThink first."
    assert resolve_system("Line one\\nline two") == "Line one\nline two"
    with pytest.raises(ConfigError, match="--system missing.txt: a value ending in .txt is read as a file"):
        resolve_system("missing.txt")


def test_system_from_file_reaches_the_prompt(tmp_path):
    (tmp_path / "sys.txt").write_text("From the file.")
    data = write_jsonl(tmp_path / "d.jsonl", [{"problem": "What is 2+2?", "answer": "4"}])
    train, _ = load_train_val([data], [], system=resolve_system(str(tmp_path / "sys.txt")), seed=0)
    assert train[0]["messages"][0] == {"role": "system", "content": "From the file."}


def test_num_proc_gives_the_same_rows(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(6)]
    one = rows_of(rows)
    two = rows_of(rows, num_proc=2)
    assert one == two and [r["solution"] for r in two] == [str(i) for i in range(6)]


def test_mixed_role_and_sharegpt_keys_in_one_file_and_missing_content(tmp_path):
    # Arrow gives every message all keys seen in the file (None where absent); each row must still read right
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"messages": [{"role": "user", "content": "a"}]}, {"messages": [{"from": "human", "value": "b"}]}],
    )
    train, _ = load_train_val([path], [], system=None, seed=0)
    assert [m[0]["role"] for m in train["messages"]] == ["user", "user"]
    assert [m[0]["content"] for m in train["messages"]] == ["a", "b"]
    with pytest.raises(DataError, match="row 0: column 'messages': a 'user' message has no content"):
        rows_of([{"messages": [{"role": "user", "content": None}]}])
