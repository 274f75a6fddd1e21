"""--max_staleness (tiny model, float32): K = 0 is the synchronous run exactly, in process and against a real
rollout server; against a real rollout server (transformers engine) with K = 2 and with --staleness_policy drop no
trained row was sampled more than K optimizer steps before the step that trains it (from each row's weight version
in completions.jsonl), and no prompt trains twice."""

from __future__ import annotations

import json

import pytest
import torch
from support import flags, server_flags
from test_server_support import rollout_server

from grpokit.config.parse import parse_train_args
from grpokit.pipeline.train import run_train
from grpokit.rewards import orms

pytestmark = pytest.mark.slow

FLOAT32 = ("--torch_dtype", "float32")
K0_RUNS = (("sync", ()), ("k0", ("--async_generate", "true", "--max_staleness", "0")))  # an explicit 0 wins


def _even_length(completions, **kwargs):
    """A 0/1 reward a random model earns about half the time, so that the steps have a loss."""
    return [float(len(c) % 2 == 0) for c in completions]


orms.register("async_test_even_length", _even_length, override=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir  # the session's tiny model (tests/conftest.py), built once


def _train(tiny, out, *extra: str, port: int | None = None):
    server = [] if port is None else flags(server_flags(port, 60))
    cfg = parse_train_args(
        flags(
            {"--model": tiny},
            "--tuner_type full --dataset builtin:arithmetic --reward_funcs async_test_even_length",
            *server,
            "--num_generations 4 --per_device_train_batch_size 8 --max_completion_length 8",
            {"--output_dir": out},
            "--save_final_model false --save_steps 100 --torch_dtype float32 --seed 3 --log_completions true",
            "--plots false",
            *extra,
        )
    )
    trainer = run_train(cfg)
    logs = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    return trainer, logs, rows


def test_max_staleness_0_is_the_synchronous_run(tiny, tmp_path):
    """An explicit 0 wins over --async_generate true: the same samples, losses and weights as the synchronous run.
    (In process here; the server-mode test below gives each run a fresh server.)"""
    runs = [_train(tiny, tmp_path / name, "--max_steps", "3", *extra) for name, extra in K0_RUNS]
    _assert_the_same_run(*runs)
    assert any(r["loss"] != 0 for r in runs[0][1])


def test_max_staleness_0_is_the_synchronous_run_in_server_mode(tiny, tmp_path):
    """The same against a real rollout server (transformers engine): each run gets a fresh server, so both see
    the same sampler state and the same /infer/ calls, one per window, in the same order."""
    runs = []
    for name, extra in K0_RUNS:
        with rollout_server(tiny, tmp_path, *FLOAT32) as server:
            runs.append(_train(tiny, tmp_path / name, "--max_steps", "3", *extra, port=server.port))
    _assert_the_same_run(*runs)
    assert any(r["grad_norm"] > 0 for r in runs[0][1])  # it trained (an on-policy GRPO loss may be 0 in value)


def _assert_the_same_run(sync, k0) -> None:
    """The K = 0 run is the synchronous one: no async metrics, the same completions, losses, rewards, weights."""
    (t_sync, logs_sync, rows_sync), (t_k0, logs_k0, rows_k0) = sync, k0
    assert not any(k.startswith("async/") for k in logs_k0[0])
    assert [r["completion"] for r in rows_k0] == [r["completion"] for r in rows_sync]
    assert [(r["loss"], r["reward"]) for r in logs_k0] == [(r["loss"], r["reward"]) for r in logs_sync]
    for (name, a), b in zip(t_sync.policy.state_dict().items(), t_k0.policy.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("policy, k", [("wait", 2), ("drop", 1)])
def test_no_trained_row_is_older_than_the_bound(tiny, tmp_path, policy, k):
    with rollout_server(tiny, tmp_path, *FLOAT32) as server:
        trainer, logs, rows = _train(
            tiny,
            tmp_path / policy,
            "--max_steps",
            "6",
            "--max_staleness",
            str(k),
            "--staleness_policy",
            policy,
            port=server.port,
        )
    assert [r["step"] for r in logs] == list(range(1, 7))
    ages = [r["step"] - 1 - r["weight_version"] for r in rows]  # the step that trains it, less its weights' step
    assert len(rows) == 6 * 8 and min(ages) >= 0 and max(ages) <= k, ages
    assert all(r["async/staleness_max"] <= k and "async/dropped" in r and "async/producer_idle_s" in r for r in logs)
    steps_of = {}
    for r in rows:
        steps_of.setdefault(r["group"], set()).add(r["step"])
    assert all(len(s) == 1 for s in steps_of.values()), steps_of  # no prompt trains in two steps
    assert len(steps_of) == 6 * 2
