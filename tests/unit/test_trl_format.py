"""TRL's standard vs conversational format, chosen from the dataset: the loader records per row whether the prompt
came as messages, and TRL-convention rewards get prompts/completions in that row's format (a mark overrides)."""

from __future__ import annotations

import pytest
from datasets import Dataset

from grpokit.data import CONVERSATIONAL_COLUMN
from grpokit.data.loading import concat_datasets
from grpokit.data.rows import normalize_rows
from grpokit.errors import ConfigError
from grpokit.rewards import RewardRunner, trl_convention

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def _flags(rows: list[dict]) -> list[bool]:
    return normalize_rows(Dataset.from_list(rows), None)[CONVERSATIONAL_COLUMN]


def test_the_loader_records_the_prompt_format_as_trl_decides_it():
    assert _flags([{"prompt": "2+2?"}]) == [False]  # a prompt string: standard
    assert _flags([{"prompt": [{"role": "user", "content": "2+2?"}]}]) == [True]  # a prompt of messages
    assert _flags([{"messages": [{"role": "user", "content": "2+2?"}]}]) == [True]
    assert _flags([{"conversations": [{"from": "human", "value": "2+2?"}]}]) == [True]  # ShareGPT messages
    assert _flags([{"question": "2+2?", "answer": "4"}]) == [False]  # ms-swift's string aliases: standard
    assert _flags([{"instruction": "Add", "input": "2+2"}]) == [False]
    # two datasets in one run keep each row's own format
    parts = [
        (name, normalize_rows(Dataset.from_list(rows), None, source=name))
        for name, rows in [("a", [{"prompt": "1+1?"}]), ("b", [{"messages": [{"role": "user", "content": "2+2?"}]}])]
    ]
    assert concat_datasets(parts)[CONVERSATIONAL_COLUMN] == [False, True]


def _kwargs(conversational: list[bool] | None) -> dict:
    full = [PROMPT + [{"role": "assistant", "content": str(k)}] for k in range(2)]
    out = {"messages": full, "prompts": [PROMPT] * 2, "solution": ["4", "4"]}
    if conversational is not None:
        out[CONVERSATIONAL_COLUMN] = conversational
    return out


def _seen(func_kwargs: list[dict]):
    def reward(prompts, completions, **kwargs):  # TRL by its signature, not marked
        func_kwargs.append({"prompts": prompts, "completions": completions, **kwargs})
        return [0.0] * len(completions)

    return reward


def test_an_unmarked_trl_reward_gets_each_rows_format():
    seen: list[dict] = []
    RewardRunner([_seen(seen)], ["r"]).compute(["0", "1"], _kwargs([True, False]))
    (got,) = seen
    assert got["prompts"] == [PROMPT, "2+2?"]  # conversational: the prompt messages; standard: the user text
    assert got["completions"] == [[{"role": "assistant", "content": "0"}], "1"]
    assert CONVERSATIONAL_COLUMN not in got and got["solution"] == ["4", "4"]  # hidden from the reward
    seen.clear()
    RewardRunner([_seen(seen)], ["r"]).compute(["0", "1"], _kwargs(None))  # rows not from the loader: standard
    assert seen[0]["completions"] == ["0", "1"] and seen[0]["prompts"] == ["2+2?", "2+2?"]


def test_an_explicit_mark_wins_over_the_dataset():
    conv_seen: list[dict] = []
    std_seen: list[dict] = []
    as_messages = trl_convention(_seen(conv_seen), conversational=True)
    as_strings = trl_convention(_seen(std_seen), conversational=False)
    RewardRunner([as_messages, as_strings], ["m", "s"]).compute(["0", "1"], _kwargs([False, True]))
    assert conv_seen[0]["completions"] == [
        [{"role": "assistant", "content": "0"}],
        [{"role": "assistant", "content": "1"}],
    ]
    assert std_seen[0]["completions"] == ["0", "1"] and std_seen[0]["prompts"] == ["2+2?", "2+2?"]


def test_trl_documentation_example_2_reads_a_conversational_dataset_when_marked_plainly():
    def format_reward_func(completions, **kwargs):  # TRL's docs: its signature is also ms-swift's
        return [1.0 if c[0]["content"].startswith("<think>") else 0.0 for c in completions]

    runner = RewardRunner([trl_convention(format_reward_func)], ["fmt"])
    kwargs = _kwargs([True, True])
    kwargs["messages"][1][-1]["content"] = "<think>"
    assert runner.compute(["0", "<think>"], kwargs)[:, 0].tolist() == [0.0, 1.0]


def test_swift_rewards_keep_strings_and_never_see_the_hidden_column():
    seen: list[dict] = []

    def swift_style(completions, solution, **kwargs):
        seen.append({"completions": completions, **kwargs})
        return [float(c == s) for c, s in zip(completions, solution, strict=True)]

    scores = RewardRunner([swift_style], ["s"]).compute(["4", "0"], _kwargs([True, True]))
    assert scores[:, 0].tolist() == [1.0, 0.0] and seen[0]["completions"] == ["4", "0"]
    assert CONVERSATIONAL_COLUMN not in seen[0]


def test_trl_convention_refuses_a_format_that_is_not_a_bool():
    with pytest.raises(ConfigError, match=r"conversational must be True, False or None, got 'yes'"):
        trl_convention(lambda completions, **kw: [], conversational="yes")
