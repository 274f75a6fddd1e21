"""rollout/evaluate.py's evaluate_policy on a fake engine: which completions it asks for, and the figures it reports
from their scores (greedy, pass@k, mean@K), without touching the training's random stream."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from grpokit.rewards.runner import RewardRunner
from grpokit.rollout.evaluate import EvalSettings, evaluate_policy


class Template:
    def with_system(self, messages):
        return messages


class ScriptedEngine:
    """Greedy: the row's ``greedy`` column; sampled: the row's ``samples`` column (one text per sample), after
    drawing from torch's global generator as a sampling engine would."""

    def __init__(self):
        self.configs = []

    def infer(self, reqs, config):
        self.configs.append(config)
        if config.temperature > 0:
            torch.rand(3)
        texts = [
            [r.data_dict["greedy"]] if config.temperature == 0 else r.data_dict["samples"][: config.n] for r in reqs
        ]
        return [
            SimpleNamespace(choices=[SimpleNamespace(message={"content": t}, finish_reason="stop") for t in ts])
            for ts in texts
        ]


def exact(completions, solution, **kwargs):
    return [float(c == s) for c, s in zip(completions, solution)]


def half_for_almost(completions, solution, **kwargs):
    """1 for the answer, 0.5 for the answer with a trailing dot (a partial score), None for an empty text."""
    return [None if not c else 1.0 if c == s else 0.5 if c == s + "." else 0.0 for c, s in zip(completions, solution)]


ROWS = [  # per prompt: c = 0, 1, 2, 4 passing samples of four
    {"messages": [{"role": "user", "content": "a"}], "solution": "1", "greedy": "1", "samples": ["0", "0", "0", "0"]},
    {"messages": [{"role": "user", "content": "b"}], "solution": "2", "greedy": "0", "samples": ["2", "0", "2.", "0"]},
    {"messages": [{"role": "user", "content": "c"}], "solution": "3", "greedy": "3", "samples": ["0", "3", "0", "3"]},
    {"messages": [{"role": "user", "content": "d"}], "solution": "4", "greedy": "0", "samples": ["4", "4", "4", "4"]},
]


def _run(settings: EvalSettings, rows=ROWS):
    engine = ScriptedEngine()
    runner = RewardRunner([exact, half_for_almost], ["exact", "partial"])
    return engine, evaluate_policy(engine, Template(), rows, runner, ["exact", "partial"], settings)


def test_greedy_alone_without_num_generations():
    engine, result = _run(EvalSettings(max_tokens=5))
    assert result.metrics == {"exact/greedy": 0.5, "partial/greedy": 0.5}
    assert [c.temperature for c in engine.configs] == [0.0] and not result.sampled_rows


def test_sampled_figures_from_the_samples_scores():
    settings = EvalSettings(max_tokens=5, num_generations=4, temperature=0.7, top_p=0.9, top_k=5, seed=3, batch_size=2)
    before = torch.random.get_rng_state()
    engine, result = _run(settings)
    assert torch.equal(torch.random.get_rng_state(), before)  # the sampled pass drew on a forked generator
    greedy, sampled = engine.configs[:2], engine.configs[2:]  # two calls of two prompts each (batch_size 2)
    assert all(c.temperature == 0 and c.n == 1 for c in greedy)
    # four samples per prompt at the run's sampling settings, a seed per call (the seed plus the first prompt's
    # index, so that the calls do not repeat each other's noise)
    assert [(c.n, c.temperature, c.top_p, c.top_k, c.seed) for c in sampled] == [
        (4, 0.7, 0.9, 5, 3),
        (4, 0.7, 0.9, 5, 5),
    ]
    m = result.metrics
    assert m["exact/greedy"] == 0.5
    # exact: c = 0, 1, 2, 4 of 4 → pass@1 .4375, pass@2 (0 + .5 + 5/6 + 1)/4, pass@4 .75 (tests/unit/test_pass_at_k)
    assert m["exact/pass@1"] == pytest.approx(0.4375)
    assert m["exact/pass@2"] == pytest.approx((0.5 + 5 / 6 + 1) / 4)
    assert m["exact/pass@4"] == pytest.approx(0.75)
    assert m["exact/mean@4"] == pytest.approx(7 / 16)
    assert m["exact/pass@1_ci_low"] < m["exact/pass@1"] < m["exact/pass@1_ci_high"]
    # partial: "2." scores 0.5, below the threshold 1.0: the same passes, but mean@4 counts the half point
    assert m["partial/pass@1"] == pytest.approx(0.4375)
    assert m["partial/mean@4"] == pytest.approx((0 + 1.5 / 4 + 0.5 + 1) / 4)
    assert len(result.sampled_rows) == 16 and result.sampled_rows[5] == {
        "prompt": "b",
        "completion": "0",
        "sample": 1,
        "exact": 0.0,
        "partial": 0.0,
    }


def test_threshold_option_counts_partial_scores_as_passes():
    _, result = _run(EvalSettings(max_tokens=5, num_generations=4, pass_threshold=0.5))
    assert result.metrics["partial/pass@1"] == pytest.approx((0 + 0.5 + 0.5 + 1) / 4)  # "2." passes now
    assert result.metrics["exact/pass@1"] == pytest.approx(0.4375)  # a 0/1 reward: the same


def test_settings_for_a_run_come_from_its_options():
    from grpokit.config.parse import parse_train_args

    cfg = parse_train_args(
        [
            "--model",
            "m/m",
            "--dataset",
            "d.jsonl",
            "--val_dataset",
            "v.jsonl",
            "--eval_steps",
            "2",
            "--num_generations_eval",
            "4",
            "--temperature",
            "0.8",
            "--top_k",
            "7",
            "--eval_pass_threshold",
            "0.5",
            "--per_device_eval_batch_size",
            "3",
            "--max_completion_length",
            "9",
            "--seed",
            "5",
        ]
    )
    assert EvalSettings.for_run(cfg) == EvalSettings(
        max_tokens=9,
        batch_size=3,
        num_generations=4,
        temperature=0.8,
        top_p=1.0,
        top_k=7,
        repetition_penalty=1.0,
        pass_threshold=0.5,
        seed=5,
    )


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ([], "without validation data would never sample"),
        (["--val_dataset", "v.jsonl", "--eval_strategy", "no"], "with --eval_strategy no would never sample"),
        (["--val_dataset", "v.jsonl", "--save_strategy", "no"], "--save_strategy no (which --eval_strategy follows)"),
        (["--val_dataset", "v.jsonl"], "without --eval_steps (or --eval_on_start true) would never sample"),
    ],
)
def test_num_generations_eval_that_would_never_sample_is_refused(extra, said):
    from grpokit.config.parse import parse_train_args
    from grpokit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--num_generations_eval 4 .*" + re.escape(said)):
        parse_train_args(["--model", "m/m", "--dataset", "d.jsonl", "--num_generations_eval", "4", *extra])


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ({"top_p": 0.0}, "--top_p 0.0: Input should be greater than 0"),
        ({"num_generations_eval": 5000}, "--num_generations_eval 5000: Input should be less than or equal to 1024"),
        ({"temperature": 0.0}, "--num_generations_eval 4 samples at --temperature, which is 0"),
        ({"eval_pass_threshold": float("nan")}, "--eval_pass_threshold nan: must be a finite reward value"),
        ({"batch_size": 0}, "--batch_size 0: must be at least 1"),
    ],
)
def test_eval_command_settings_are_checked_in_one_line(bad, said):
    from grpokit.errors import ConfigError
    from grpokit.pipeline.evaluate import eval_settings

    args = {
        "num_generations_eval": 4,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "eval_pass_threshold": 1.0,
        "max_new_tokens": 8,
        "batch_size": 4,
        "seed": 0,
    }
    with pytest.raises(ConfigError, match="^" + re.escape(said)) as err:
        eval_settings(SimpleNamespace(**{**args, **bad}))
    assert "\n" not in str(err.value)
