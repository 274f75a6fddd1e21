"""--max_length by a cheap bound: the same rows over the limit as tokenizing every prompt, for random prompts of
many lengths, scripts and role sequences; short prompts are never tokenized, however many rows there are."""

from __future__ import annotations

import random

import datasets
import pytest

from grpokit.template.prompt_bounds import lengths_over_bound
from grpokit.template.prompts import PromptOptions
from grpokit.testing import build_tiny_tokenizer

WORDS = ["hi", "über", "数学", "😀", "  ", "\n", "x=1+2;", "<|im_start|>", "the", "Ω≈ç√∫"]


@pytest.fixture(scope="module")
def template():
    return PromptOptions().template(build_tiny_tokenizer(), system="You are terse.")


class Counting:
    """The template, counting the prompts it tokenizes."""

    def __init__(self, template) -> None:
        self.template, self.tokenized = template, 0

    def prompt_lengths(self, conversations):
        self.tokenized += len(conversations)
        return self.template.prompt_lengths(conversations)


@pytest.mark.parametrize("seed", range(3))
def test_the_bound_finds_exactly_the_rows_tokenizing_finds(template, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(300):
        roles = rng.choice([["user"], ["system", "user"], ["user", "assistant", "user"]])
        msgs = [{"role": r, "content": "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 60)))} for r in roles]
        rows.append({"messages": msgs})
    ds = datasets.Dataset.from_list(rows)
    exact = template.prompt_lengths(ds["messages"])  # the plain loop: every prompt tokenized
    for limit in (20, 60, 150, 400):
        counting = Counting(template)
        found = lengths_over_bound(ds, counting, limit)
        assert {i for i, n in found.items() if n > limit} == {i for i, n in enumerate(exact) if n > limit}
        assert all(found[i] == exact[i] for i in found)
        assert counting.tokenized - len({tuple(m["role"] for m in r["messages"]) for r in rows}) == len(found)


def test_short_prompts_are_not_tokenized(template):
    ds = datasets.Dataset.from_list(
        [{"messages": [{"role": "user", "content": f"what is {i} + 1?"}]} for i in range(5000)]
    )
    counting = Counting(template)
    assert lengths_over_bound(ds, counting, 1020) == {}
    assert counting.tokenized == 1  # the template's overhead for the one role sequence
