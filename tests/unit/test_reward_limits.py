"""Limits user code cannot defeat: a reward under --reward_timeout runs in a process the runner kills (a reward
stuck in C code that holds the GIL included), what rewards start dies with them or with the run, a failing batch
is bisected instead of re-called per sample, return shapes are strict, and paths are absolute from the start (an
agent that blocks the event loop: tests/integration/test_agents_budgets.py). Processes are checked from outside
(/proc), not by the reward's word."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from light_rewards import (
    backtracking_regex,
    grader_that_hangs_in_c,
    raises_on_bad,
    sleeps_in_c_holding_the_gil,
    starts_a_server_and_hangs,
)

from grpokit.config.resolve import resolve
from grpokit.errors import RewardError
from grpokit.rewards import RewardRunner
from grpokit.rewards.descendants import reap_descendants


def _alive(pid: int) -> bool:
    """Running (not a zombie), read from /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("reward", [sleeps_in_c_holding_the_gil, backtracking_regex])
def test_a_reward_holding_the_gil_in_c_is_cut_off_and_the_trainer_keeps_running(reward):
    ticks, stop = [0], threading.Event()

    def trainer_thread():
        while not stop.wait(0.01):
            ticks[0] += 1

    threading.Thread(target=trainer_thread, daemon=True).start()
    with RewardRunner([reward], ["stuck"], timeout=1.0) as runner:
        before = ticks[0]
        with pytest.raises(RewardError, match=r"reward 'stuck' timed out after 1 s \(--reward_timeout 1\)"):
            runner.compute(["a", "b"], {})
        during = ticks[0] - before
    stop.set()
    assert during >= 10  # the GIL stayed free here (0 while a reward holds this process's)


def test_what_a_timed_out_reward_started_dies_with_its_worker(tmp_path):
    pid_file = tmp_path / "pids"
    with RewardRunner([starts_a_server_and_hangs], ["server"], timeout=2.0) as runner:
        with pytest.raises(RewardError, match="timed out"):
            runner.compute(["a"], {"pid_file": [str(pid_file)]})
        pids = [int(p) for p in pid_file.read_text().split()]
        assert len(pids) == 2
        assert not any(_alive(p) for p in pids)


def test_processes_a_reward_or_agent_abandons_end_with_the_run(tmp_path):
    pid_file = tmp_path / "pid"
    with reap_descendants():  # an orphan of a shell (re-parented to the run) and a setsid daemon
        subprocess.run(["sh", "-c", f"sleep 300 & echo $! > {pid_file}"], check=True)
        subprocess.run(["setsid", "sh", "-c", f"sleep 301 & echo $! >> {pid_file}"], check=True)
        time.sleep(0.2)
        pids = [int(p) for p in pid_file.read_text().split()]
        assert all(_alive(p) for p in pids)
    assert not any(_alive(p) for p in pids)


@pytest.mark.parametrize("timeout", [None, 30.0])
def test_a_failing_batch_is_bisected_not_called_once_per_sample(tmp_path, timeout):
    texts = [f"ok{i}" for i in range(32)]
    texts[21] = texts[27] = "bad"
    calls = tmp_path / "calls"
    with RewardRunner([raises_on_bad], ["picky"], timeout=timeout) as runner:
        with pytest.raises(RewardError, match=r"raised ValueError: cannot score bad \(first failing sample 21 'bad'\)"):
            runner.compute(texts, {"calls": [str(calls)] * 32})
    sizes = [int(n) for n in calls.read_text().split()]
    assert len(sizes) <= 1 + 5 + 1  # the batch, log2(32) halvings, one check of the last
    assert max(sizes[1:]) <= 16


@pytest.mark.parametrize(
    "out, shape",
    [
        (torch.ones(2, 2), "[2, 2]"),
        (torch.ones(4, 1), "[4, 1]"),
        (np.ones((1, 4)), "[1, 4]"),
        (torch.tensor(1.0), "[]"),
    ],
)
def test_a_return_that_is_not_n_scores_in_one_dimension_is_refused(out, shape):
    with pytest.raises(RewardError, match=rf"reward 'shaped' returned a \w+ of shape {re.escape(shape)}; need a list"):
        RewardRunner([lambda completions, **kw: out], ["shaped"]).compute(["a", "b", "c", "d"], {})


@pytest.mark.parametrize("out", [torch.ones(4), np.ones(4), [1, 1.0, None, np.float32(1)], (1, 1, 1, 1)])
def test_one_dimensional_scores_are_accepted(out):
    scores = RewardRunner([lambda completions, **kw: out], ["flat"]).compute(["a", "b", "c", "d"], {})
    assert scores.shape == (4, 1)


def test_relative_paths_are_absolute_from_the_start(tmp_path, monkeypatch):
    from grpokit.config.parse import parse_train_args

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"prompt": "a"}\n')
    cfg = resolve(parse_train_args(["--output_dir", "out", "--dataset", "data.jsonl", "builtin:arithmetic"]))
    assert cfg.training.output_dir == str(tmp_path / "out")
    assert cfg.data.dataset == [str(tmp_path / "data.jsonl"), "builtin:arithmetic"]
    monkeypatch.chdir("/")  # a reward that changes directory does not move the run's files
    assert resolve(cfg).training.output_dir == str(tmp_path / "out")


def test_a_grader_past_the_samples_deadline_is_killed_and_the_trainer_keeps_running(tmp_path):
    from grpokit.rewards.grading_pool import GraderPool

    ticks, stop = [0], threading.Event()
    threading.Thread(target=lambda: [ticks.__setitem__(0, ticks[0] + 1) for _ in iter(lambda: stop.wait(0.01), True)],
                     daemon=True).start()  # fmt: skip
    pool = GraderPool(1, serve=grader_that_hangs_in_c)
    pid_file = tmp_path / "pids"
    before = ticks[0]
    score, failures = pool.grade(str(pid_file), None, None, None, budget_s=0.5)
    during = ticks[0] - before
    stop.set()
    assert (score, dict(failures)) == (0.0, {"timeout": 1})
    assert during >= 10  # the trainer's threads ran while the grader was stuck
    pids = [int(p) for p in pid_file.read_text().split()]
    assert pids[0] != os.getpid() and not any(_alive(p) for p in pids)  # the grader and what it started: gone
    pool.close()
