"""reasoning-gym tasks (data/reasoning_gym.py, rewards/reasoning_gym.py): rows from a task's generator, the task's own
scorer as the reward (a known-correct, a known-wrong and a partly-right answer), one-line errors that list what is
available, and a 3-step training run whose logged rewards are the scorer's verdicts on its completions."""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest
from support import flags

import grpokit
from grpokit.errors import DataError

SPEC = "reasoning_gym:basic_arithmetic?size=16&seed=1&max_terms=3"


def _task(**config):
    import reasoning_gym

    return reasoning_gym.create_dataset("basic_arithmetic", **config)


def test_rows_are_the_tasks_entries():
    from grpokit.data.loading import load_dataset_spec

    ds = load_dataset_spec(SPEC)
    reference = _task(size=16, seed=1, max_terms=3)
    assert len(ds) == 16
    for i in (0, 7, 15):
        ref = json.loads(ds[i]["reasoning_gym_entry"])
        assert ref == {
            "task": "basic_arithmetic",
            "config": {"size": 16, "seed": 1, "max_terms": 3},
            "index": i,
            "answer": reference[i]["answer"],
        }
        assert ds[i]["messages"] == [{"role": "user", "content": reference[i]["question"]}]
        assert ds[i]["solution"] == reference[i]["answer"]
    assert len(load_dataset_spec(SPEC + "#4")) == 4  # #N sub-samples as for any spec


def test_reward_is_the_tasks_scorer():
    from grpokit.data.loading import load_dataset_spec
    from grpokit.rewards import orms

    row = load_dataset_spec(SPEC)[3]
    answer = row["solution"]
    reward = orms["reasoning_gym"]()
    texts = [
        f"<think>easy</think> <answer>{answer}</answer>",  # the tagged answer: correct
        answer,  # no tags: the whole completion is the answer
        "<answer>wrong</answer>",  # wrong
        f"so it is {answer}",  # basic_arithmetic's scorer gives partial credit: len(oracle) / len(answer)
        "",
    ]
    scores = reward(texts, reasoning_gym_entry=[row["reasoning_gym_entry"]] * len(texts))
    assert scores == [1.0, 1.0, 0.0, pytest.approx(len(answer) / len(f"so it is {answer}")), 0.0]
    assert reward(["x"], reasoning_gym_entry=[None]) == [None]  # a row of another dataset: not scored


def test_a_wrong_task_name_lists_the_available_ones():
    from grpokit.data.loading import load_dataset_spec

    with pytest.raises(DataError) as err:
        load_dataset_spec("reasoning_gym:basic_arithmatic?size=4")
    message = str(err.value)
    assert "\n" not in message and "unknown reasoning-gym task 'basic_arithmatic'" in message
    assert "did you mean basic_arithmetic" in message
    assert "available: " in message and all(t in message for t in ("chain_sum", "leg_counting", "word_sorting"))


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        (
            "reasoning_gym:basic_arithmetic?max_termz=3",
            "max_termz is not an option of reasoning-gym's basic_arithmetic; its options: min_terms, max_terms",
        ),
        ("reasoning_gym:basic_arithmetic?size=0", "size=0 must be a whole number in [1, 1000000]"),
        (
            "reasoning_gym:basic_arithmetic?min_terms=5&max_terms=2",
            "refuses this config (max_terms must be >= min_terms)",
        ),
    ],
)
def test_bad_task_options_are_one_line(spec, said):
    from grpokit.data.loading import load_dataset_spec

    with pytest.raises(DataError, match="^--dataset .*" + re.escape(said)):
        load_dataset_spec(spec)


def test_without_the_package_the_error_says_how_to_install(monkeypatch):
    from grpokit.data.loading import load_dataset_spec

    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)  # an import of it raises ImportError
    with pytest.raises(DataError, match=r"need the reasoning-gym package.*pip install 'grpokit\[reasoning-gym\]'"):
        load_dataset_spec("reasoning_gym:chain_sum?size=3&seed=9")  # a config no earlier test built


def test_nothing_of_reasoning_gym_on_the_default_import_path():
    """reasoning_gym is imported only inside functions of grpokit (an optional extra): no module-level import."""
    top_level = []
    for path in Path(grpokit.__file__).parent.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module-level statements only
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            top_level += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "reasoning_gym"]
    assert top_level == []


@pytest.mark.slow
def test_a_task_trains_three_steps_with_its_scorer(tiny_model_dir, tmp_path):
    from reasoning_gym.utils import extract_answer

    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    out = tmp_path / "run"
    run_train(
        parse_train_args(
            flags(
                {"--model": tiny_model_dir, "--dataset": SPEC, "--output_dir": out},
                "--tuner_type full --reward_funcs reasoning_gym --num_generations 4",
                "--per_device_train_batch_size 8 --max_completion_length 8 --learning_rate 1e-3",
                "--torch_dtype float32 --seed 0 --disable_tqdm true --max_steps 3 --log_completions true",
                "--save_strategy no",
            )
        )
    )
    log = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3]
    assert all("rewards/reasoning_gym/mean" in r for r in log if "loss" in r)
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 8
    task = _task(size=16, seed=1, max_terms=3)
    entry_of = {task[i]["question"]: task[i] for i in range(len(task))}
    for row in rows:  # each logged reward is the task's verdict on that completion
        entry = entry_of[row["prompt"]]
        answer = extract_answer(row["completion"])
        expected = task.score_answer(answer=row["completion"].strip() if answer is None else answer, entry=entry)
        assert row["reasoning_gym"] == pytest.approx(expected)
