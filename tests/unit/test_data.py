"""Dataset specs, row normalisation, built-in tasks and their error messages (all offline, tiny files)."""

from __future__ import annotations

import ast
import json
import logging
import operator
import re
import socket
import time
from collections import Counter

import datasets
import pytest
from support import write_jsonl

from grpokit.data import hub
from grpokit.data.builtin import BUILTIN_TASKS, builtin_rows
from grpokit.data.loading import load_dataset_spec, load_train_val, normalize_rows
from grpokit.errors import ConfigError, DataError

USER_HI = [{"role": "user", "content": "hi"}]


def numbered(n: int) -> list[dict]:
    return [{"query": f"q{i}", "answer": str(i)} for i in range(n)]


# ------------------------------------------------------------------ spec forms


def test_jsonl_messages_rows_keep_every_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": USER_HI, "solution": "1", "target": 7}])
    ds = normalize_rows(load_dataset_spec(str(path)), None)
    assert ds[0] == {"messages": USER_HI, "solution": "1", "target": 7, "_conversational": True}


def test_csv_query_answer_becomes_messages_and_solution(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("query,answer,level\nWhat is 2+2?,4,easy\n")
    ds = normalize_rows(load_dataset_spec(str(path)), None)
    # query is consumed into messages; answer is kept and copied to solution (CSV reads 4 as an int)
    assert ds[0]["messages"] == [{"role": "user", "content": "What is 2+2?"}]
    assert ds[0]["solution"] == ds[0]["answer"] == 4
    assert ds[0]["level"] == "easy" and "query" not in ds.column_names


def test_parquet_prompt_string(tmp_path):
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"prompt": "hi", "solution": "x"}]).to_parquet(str(path))
    ds = normalize_rows(load_dataset_spec(str(path)), None)
    assert ds[0] == {"messages": USER_HI, "solution": "x", "_conversational": False}


def test_json_list_with_prompt_as_messages(tmp_path):
    path = tmp_path / "d.json"
    conv = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    path.write_text(json.dumps([{"prompt": conv, "solution": "a"}]))
    ds = normalize_rows(load_dataset_spec(str(path)), None)
    assert ds[0]["messages"] == conv and "prompt" not in ds.column_names


def test_saved_dataset_folder(tmp_path):
    datasets.Dataset.from_list([{"messages": USER_HI}]).save_to_disk(str(tmp_path / "saved"))
    assert load_dataset_spec(str(tmp_path / "saved"))[0]["messages"] == USER_HI


def test_builtin_spec_train_and_test():
    assert len(load_dataset_spec("builtin:arithmetic")) == 300
    assert len(load_dataset_spec("builtin:arithmetic:test")) == 100


# ------------------------------------------------------------------ normalisation


def test_system_prompt_added_only_where_missing():
    ds = datasets.Dataset.from_list(
        [
            {"messages": USER_HI},
            {"messages": [{"role": "system", "content": "own"}, *USER_HI]},
        ]
    )
    out = normalize_rows(ds, "Be brief.")
    assert out[0]["messages"] == [{"role": "system", "content": "Be brief."}, *USER_HI]
    assert out[1]["messages"][0] == {"role": "system", "content": "own"}


def test_row_system_column_wins_over_option_and_is_consumed():
    ds = datasets.Dataset.from_list([{"query": "hi", "system": "row"}, {"query": "hi", "system": None}])
    out = normalize_rows(ds, "option")
    assert out[0]["messages"][0]["content"] == "row"
    assert out[1]["messages"][0]["content"] == "option"
    assert out.column_names == ["messages", "_conversational"]


def test_trailing_assistant_becomes_solution():
    ds = datasets.Dataset.from_list([{"messages": [*USER_HI, {"role": "assistant", "content": "42"}]}])
    out = normalize_rows(ds, None)
    assert out[0] == {"messages": USER_HI, "solution": "42", "_conversational": True}


def test_existing_solution_is_not_overwritten():
    ds = datasets.Dataset.from_list([{"query": "hi", "answer": "a", "solution": "s"}])
    assert normalize_rows(ds, None)[0]["solution"] == "s"


def test_no_solution_column_is_invented():
    out = normalize_rows(datasets.Dataset.from_list([{"query": "hi", "nums": [1, 2]}]), None)
    assert out.column_names == ["nums", "messages", "_conversational"]


def test_bad_prompt_value_names_the_row():
    ds = datasets.Dataset.from_list([{"query": "ok"}, {"query": None}])
    with pytest.raises(DataError, match="row 1 has an empty prompt"):
        normalize_rows(ds, None, source="d.jsonl")


# ------------------------------------------------------------------ errors


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        load_dataset_spec(str(tmp_path / "nope.jsonl"))


def test_unsupported_extension(tmp_path):
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(DataError, match=r"unsupported file type '\.txt'.*\.jsonl"):
        load_dataset_spec(str(tmp_path / "notes.txt"))


def test_no_prompt_column_lists_columns_and_accepted_names(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text1": "q", "answer": "a"}])
    with pytest.raises(DataError) as err:
        load_train_val([str(path)], [], system=None, seed=0)
    message = str(err.value)
    assert "d.jsonl" in message and "columns: text1, answer" in message and "--columns" in message
    assert all(name in message for name in ("messages", "query", "prompt"))
    assert "\n" not in message


@pytest.mark.parametrize("name,text", [("e.jsonl", ""), ("e.json", "[]"), ("e.csv", "query,answer\n")])
def test_empty_file(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match="has no rows"):
        load_dataset_spec(str(tmp_path / name))


def test_empty_parquet(tmp_path):
    path = tmp_path / "e.parquet"
    datasets.Dataset.from_dict({"query": []}, features=datasets.Features(query=datasets.Value("string"))).to_parquet(
        str(path)
    )
    with pytest.raises(DataError, match="has no rows"):
        load_dataset_spec(str(path))


@pytest.mark.parametrize("suffix", ["#abc", "#0", "#-3"])
def test_bad_sample_count(tmp_path, suffix):
    path = write_jsonl(tmp_path / "d.jsonl", numbered(3))
    with pytest.raises(DataError, match="positive row count"):
        load_dataset_spec(f"{path}{suffix}")


def test_unknown_builtin_task_and_split():
    with pytest.raises(DataError, match="unknown built-in task; available: builtin:arithmetic"):
        load_dataset_spec("builtin:nope")
    with pytest.raises(DataError, match="unknown split 'dev'"):
        load_dataset_spec("builtin:arithmetic:dev")


def _closed_port() -> int:
    with socket.socket() as s:  # bind, read the port, close: nothing listens there afterwards
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_hub_fails_fast(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(hub, "_offline", lambda: False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    start = time.monotonic()
    with pytest.raises(DataError, match=r"could not reach the hub for 'org/name'.*builtin:") as err:
        load_dataset_spec("org/name#10")
    assert time.monotonic() - start < 5 and "\n" not in str(err.value)


def test_offline_mode_reads_only_the_cache(monkeypatch):
    import datasets.config
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match="offline mode on"):
        load_dataset_spec("grpokit-test/not-cached")


# ------------------------------------------------------------------ #N sub-sampling


def test_subsample_is_seeded(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", numbered(50))
    a = load_dataset_spec(f"{path}#10", seed=1)["answer"]
    b = load_dataset_spec(f"{path}#10", seed=1)["answer"]
    c = load_dataset_spec(f"{path}#10", seed=2)["answer"]
    assert a == b and len(a) == len(set(a)) == 10
    assert a != c  # 50 choose 10 orderings: two seeds agreeing would be a broken shuffle


def test_subsample_larger_than_dataset_repeats_rows_as_ms_swift(tmp_path, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", numbered(3))
    with caplog.at_level(logging.WARNING):
        ds = load_dataset_spec(f"{path}#8", seed=1)
    # 8 = every row twice, then 2 rows of the seeded shuffle (ms-swift's sample_dataset)
    assert ds["answer"][:6] == ["0", "1", "2"] * 2 and len(ds) == 8
    shuffled = datasets.Dataset.from_list(numbered(3)).shuffle(seed=1)["answer"]
    assert ds["answer"][6:] == shuffled[:2] and ds.column_names == ["query", "answer"]
    assert "has only 3; the rows repeat" in caplog.text


# ------------------------------------------------------------------ several specs, validation split


def test_concatenation_unions_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"query": "hi", "answer": "1"}])
    train, val = load_train_val([str(path), "builtin:countdown#2"], [], system=None, seed=0)
    assert val is None and len(train) == 3
    assert set(train.column_names) == {"messages", "answer", "solution", "nums", "target", "_conversational"}
    assert train[0]["nums"] is None and train[0]["solution"] == "1"
    assert train[1]["answer"] is None and len(train[1]["nums"]) in (3, 4)


def test_concatenation_type_clash_is_a_data_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"query": "hi", "nums": "1,2,3"}])
    with pytest.raises(DataError, match="column 'nums'"):
        load_train_val([str(path), "builtin:countdown#2"], [], system=None, seed=0)


def test_split_dataset_ratio_and_val_dataset(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", numbered(20))
    train, val = load_train_val([str(path)], [], system=None, seed=0, split_dataset_ratio=0.25)
    # 20 rows x 0.25 = 5 held out, 15 left, no overlap
    assert (len(train), len(val)) == (15, 5)
    assert not set(train["solution"]) & set(val["solution"])
    train, val = load_train_val([str(path)], ["builtin:arithmetic:test#4"], system="s", seed=0)
    assert len(val) == 4 and val[0]["messages"][0] == {"role": "system", "content": "s"}


def test_load_train_val_rejects_bad_options():
    with pytest.raises(ConfigError, match="--split_dataset_ratio 1.5"):
        load_train_val(["builtin:arithmetic"], [], system=None, seed=0, split_dataset_ratio=1.5)
    with pytest.raises(ConfigError, match="--dataset is empty"):
        load_train_val([], [], system=None, seed=0)


# ------------------------------------------------------------------ built-in tasks

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.BinOp):
        return _BINOPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    assert isinstance(node, ast.Constant) and isinstance(node.value, int)
    return node.value


def test_arithmetic_rows_are_correct_and_splits_disjoint():
    train, test = builtin_rows("arithmetic", "train", 0), builtin_rows("arithmetic", "test", 0)
    prompts = lambda rows: {r["messages"][0]["content"] for r in rows}  # noqa: E731
    assert (len(prompts(train)), len(prompts(test))) == (300, 100)
    assert not prompts(train) & prompts(test)
    for row in train + test:
        a, b = map(int, re.match(r"What is (\d+) \+ (\d+)\?", row["messages"][0]["content"]).groups())
        assert 1 <= a <= 20 and 1 <= b <= 20 and row["solution"] == str(a + b)


def test_subtraction_rows_cover_every_pair_once_with_positive_answers():
    train, test = builtin_rows("subtraction", "train", 0), builtin_rows("subtraction", "test", 0)
    pairs = {
        tuple(map(int, re.match(r"What is (\d+) - (\d+)\?", r["messages"][0]["content"]).groups())): r["solution"]
        for r in train + test
    }
    assert (len(train), len(test), len(pairs)) == (680, 100, 780)  # every pair 1 <= b < a <= 40, in one split
    assert all(1 <= b < a <= 40 and sol == str(a - b) for (a, b), sol in pairs.items())
    assert builtin_rows("subtraction", "test", 1) != test  # --seed orders the rows ...
    assert sorted(map(str, builtin_rows("subtraction", "test", 1))) == sorted(map(str, test))  # ... not the split


def test_demo_configs_parse_and_name_their_tasks():
    from grpokit.config.parse import DEMO_YAML, parse_train_args

    harder = DEMO_YAML.with_name("demo_subtraction.yaml")
    cfg = parse_train_args(["--config", str(harder)])
    assert cfg.data.dataset == ["builtin:subtraction"] and cfg.data.val_dataset == ["builtin:subtraction:test"]
    assert cfg.model.model is None  # the built-in demo model, as for `grpokit train`


def test_countdown_solutions_use_each_number_once_and_hit_target():
    train, test = builtin_rows("countdown", "train", 0), builtin_rows("countdown", "test", 0)
    key = lambda r: (tuple(sorted(r["nums"])), r["target"])  # noqa: E731
    assert (len(train), len(test)) == (2000, 200)
    assert not {key(r) for r in train} & {key(r) for r in test}
    for row in train[:300] + test:
        used = sorted(int(n) for n in re.findall(r"\d+", row["solution"]))
        assert used == sorted(row["nums"]) and len(row["nums"]) in (3, 4)
        assert _evaluate(ast.parse(row["solution"], mode="eval")) == row["target"]
        assert str(row["target"]) in row["messages"][0]["content"]


def test_guess_number_rows():
    test = builtin_rows("guess_number", "test", 0)
    assert sorted(r["env_config"]["secret"] for r in test) == list(range(1, 17))
    assert {r["env_config"]["name"] for r in test} == {"guess_number"}
    train = Counter(r["env_config"]["secret"] for r in builtin_rows("guess_number", "train", 0))
    assert train == {k: 8 for k in range(1, 17)}


@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_builtin_content_is_fixed_and_seed_only_orders(name):
    a, b, c = (builtin_rows(name, "test", s) for s in (0, 0, 1))
    assert a == b and a != c
    canon = lambda rows: sorted(json.dumps(r, sort_keys=True, default=repr) for r in rows)  # noqa: E731
    assert canon(a) == canon(c)


def test_val_dataset_errors_name_their_option(tmp_path):
    with pytest.raises(DataError, match=r"^--val_dataset '.*nope\.jsonl': file not found"):
        load_train_val(["builtin:arithmetic#2"], [str(tmp_path / "nope.jsonl")], system=None, seed=0)
