"""CHORD's options and SFT rows: one-line errors naming the option, the value (or the row) and the fix."""

from __future__ import annotations

import pytest
from support import flags, write_jsonl

from grpokit.config.parse import parse_train_args
from grpokit.errors import ConfigError, DataError

CHORD = flags(
    "--chord_sft_dataset expert.jsonl --chord_sft_per_device_train_batch_size 1 --chord_mu_peak 0.9",
    "--chord_mu_valley 0.05",
)


def _args(*extra):
    return ["--model", "org/name", "--max_steps", "1", *extra]


def _error(*extra) -> str:
    with pytest.raises(ConfigError) as e:
        parse_train_args(_args(*extra))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_complete_chord_options_parse_and_unset_steps_become_zero():
    a = parse_train_args(_args(*CHORD)).algorithm
    assert a.chord_sft_dataset == ["expert.jsonl"] and a.chord_mu_peak == 0.9 and a.chord_mu_valley == 0.05
    assert (a.chord_mu_warmup_steps, a.chord_mu_decay_steps) == (0, 0)


@pytest.mark.parametrize("missing", ["--chord_sft_per_device_train_batch_size", "--chord_mu_peak", "--chord_mu_valley"])
def test_chord_needs_its_batch_size_peak_and_valley(missing):
    i = CHORD.index(missing)
    msg = _error(*(CHORD[:i] + CHORD[i + 2 :]))
    assert msg.startswith("--chord_sft_dataset needs " + missing)


@pytest.mark.parametrize(
    "extra, start",
    [
        (["--chord_mu_peak", "0.1", "--chord_mu_valley", "0.5"], "--chord_mu_peak 0.1 is below --chord_mu_valley 0.5"),
        (["--chord_mu_peak", "1.5"], "--chord_mu_peak 1.5: "),
        (["--chord_mu_warmup_steps", "-1"], "--chord_mu_warmup_steps -1: must be ≥ 0"),
        (["--chord_mu_decay_steps", "-3"], "--chord_mu_decay_steps -3: must be ≥ 0"),
        (["--chord_sft_per_device_train_batch_size", "0"], "--chord_sft_per_device_train_batch_size 0: must be ≥ 1"),
    ],
)
def test_bad_schedule_values_name_the_option_and_value(extra, start):
    assert _error(*CHORD, *extra).startswith(start)


@pytest.mark.parametrize(
    "flag",
    [
        ["--chord_mu_peak", "0.5"],
        ["--chord_enable_phi_function", "true"],
        ["--chord_sft_per_device_train_batch_size", "2"],
    ],
)
def test_a_chord_setting_without_the_sft_dataset_is_an_error(flag):
    msg = _error(*flag)
    assert msg.startswith(flag[0]) and "add --chord_sft_dataset" in msg


def _load(tmp_path, rows, tokenizer):
    from grpokit.trainers.chord_sft import load_chord_sft_dataset

    path = write_jsonl(tmp_path / "expert.jsonl", rows)
    cfg = parse_train_args(_args(*CHORD[2:], "--chord_sft_dataset", str(path)))
    return load_chord_sft_dataset(cfg, tokenizer)


@pytest.fixture(scope="module")
def tokenizer():
    from grpokit.testing import build_tiny_tokenizer

    return build_tiny_tokenizer()


def test_sft_rows_take_the_final_assistant_message_or_the_reply_column(tmp_path, tokenizer):
    ds = _load(
        tmp_path,
        [
            {"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "r1"}]},
            {"messages": [{"role": "user", "content": "q2"}], "response": "r2"},
        ],
        tokenizer,
    )
    assert ds["solution"] == ["r1", "r2"]
    assert [m[-1]["content"] for m in ds["messages"]] == ["q1", "q2"]  # the reply is not in the prompt
    assert _load(tmp_path, [{"problem": "p", "solution": "s"}], tokenizer)["solution"] == ["s"]
    assert _load(tmp_path, [{"query": "q", "answer": "a"}], tokenizer)["solution"] == ["a"]


def test_an_sft_row_without_a_reply_names_the_row_and_the_columns(tmp_path, tokenizer):
    rows = [
        {"messages": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "r1"}], "id": 0},
        {"messages": [{"role": "user", "content": "q2"}], "id": 1},
    ]
    with pytest.raises(DataError) as e:
        _load(tmp_path, rows, tokenizer)
    msg = str(e.value)
    assert "--chord_sft_dataset" in msg and "row 1 has no reference reply" in msg and "id" in msg
    assert "final assistant message" in msg and "\n" not in msg
