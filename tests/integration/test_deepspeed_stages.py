"""--deepspeed for every stage (DeepSpeed driven directly, grpokit/distributed/zero.py): a single process started with
no launcher (`python -m grpokit train`, no MPI) and 2 gloo processes give what a plain one-process run gives.

The deterministic-completion plugin of test_distributed.py makes runs differ only by how the work is split, so
losses (1e-5) and parameters (1e-4) after 3 steps are compared with one plain process, with a reference model
(beta > 0): ZeRO-0, ZeRO-2, ZeRO-3 and ZeRO-3 with offload in one process, ZeRO-3 with gradient accumulation, a ZeRO-2
checkpoint resumed in one process, and ZeRO-1 in 2 processes (DDP's split). Each logs DeepSpeed's gradient norm,
the plain run's on the first step.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_process import run_grpokit
from test_distributed import PLUGIN, B, _args, _dumps, _log_rows, _max_diff, _one_process, _params, make_setup
from test_sharded_fsdp import ENGINE_CHECK, STEPS, _check_same, _run

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="needs the deepspeed extra (pip install 'grpokit[deepspeed]')",
    ),
]
KL = ("--beta", "0.04")
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> SimpleNamespace:
    return make_setup(tmp_path_factory.mktemp("deepspeed"), PLUGIN + ENGINE_CHECK)


def _solo(setup, name: str, batch: int, *extra: str) -> Path:
    """`python -m grpokit train` in one process with no launcher (none of its variables set)."""
    run = setup.root / name
    (run / "dump").mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(
        OMP_NUM_THREADS="1", GRPOKIT_TEST_DUMP=str(run / "dump"), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    args = _args(setup.model, setup.data, run / "out", setup.plugin, batch, *STEPS, *KL, *extra)
    proc = run_grpokit(["train", *args], env=env, timeout=300)  # a forked process (cli_process.py)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return run


def _check_one_process(plain: Path, other: Path, micro_steps: int = 3) -> None:
    """Same rewards, advantages and losses (1e-5) and parameters (1e-4) as the plain one-process run; the
    in-process engine sampled from the trained weights."""
    (a,), (b,) = _dumps(plain / "dump", 1), _dumps(other / "dump", 1)
    for kind in ("window", "micro"):
        xs, ys = ([r for r in rows if r["kind"] == kind] for rows in (a, b))
        assert len(xs) == len(ys) == (3 if kind == "window" else micro_steps)
        for x, y in zip(xs, ys, strict=True):
            for key in ("rewards", "advantages", "loss"):
                if key in x:
                    assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-7), (kind, key)
    assert _max_diff(_params(plain / "dump"), _params(other / "dump")) < 1e-4
    assert [r["diff"] for r in b if r["kind"] == "engine"] == [0.0]
    _check_grad_norm(plain, other)


def _check_grad_norm(plain: Path, other: Path) -> None:
    """DeepSpeed's gradient norm (``engine.get_global_grad_norm()`` after the step) is logged at every optimizer
    step, and the first step's equals the plain run's norm before clipping (the same weights, the same batch)."""
    ours, theirs = ([r.get("grad_norm") for r in _log_rows(run / "out")] for run in (plain, other))
    assert len(theirs) == len(ours) == 3 and None not in theirs, theirs
    assert theirs[0] > 0 and theirs[0] == pytest.approx(ours[0], rel=1e-5, abs=2e-6)


@pytest.fixture(scope="module")
def plain(setup) -> Path:
    return _run(setup, "plain1", 1, *KL)


@pytest.fixture(scope="module")
def zero2(setup) -> Path:
    return _solo(setup, "zero2_solo", B * 2, "--deepspeed", "zero2")


def test_zero2_in_one_process_without_a_launcher_matches_plain(plain, zero2):
    _check_one_process(plain, zero2)
    assert (zero2 / "out" / "checkpoint-2" / "state" / "deepspeed" / "state").is_dir()


@pytest.mark.parametrize("preset", ["zero0", "zero3", "zero3_offload"])
def test_one_process_matches_plain(setup, plain, preset):
    """zero0 keeps no gradient norm of its own: grpokit's (of the reduced gradients) is the plain run's."""
    _check_one_process(plain, _solo(setup, f"{preset}_solo", B * 2, "--deepspeed", preset))


def test_zero3_with_gradient_accumulation_matches_plain(setup):
    """DeepSpeed counts the micro-steps (its gradient_accumulation_steps) and steps at the boundary only."""
    accumulate = ("--gradient_accumulation_steps", "2")
    plain = setup.root / "plain_ga"
    _one_process(
        _args(setup.model, setup.data, plain / "out", setup.plugin, B, *STEPS, *KL, *accumulate), plain / "dump"
    )
    _check_one_process(plain, _solo(setup, "zero3_ga", B, *accumulate, "--deepspeed", "zero3"), micro_steps=6)


def test_zero2_resumes_in_one_process(setup, zero2):
    resumed = setup.root / "zero2_resumed"
    shutil.copytree(zero2 / "out", resumed / "out")
    shutil.rmtree(resumed / "out" / "checkpoint-3")
    run = _solo(
        setup,
        "zero2_resumed",
        B * 2,
        "--deepspeed",
        "zero2",
        "--resume_from_checkpoint",
        str(resumed / "out" / "checkpoint-2"),
    )
    windows = [x for x in _dumps(run / "dump", 1)[0] if x["kind"] == "window"]
    assert [w["step"] for w in windows] == [2]  # only the third step ran
    assert _max_diff(_params(run / "dump"), _params(zero2 / "dump")) < 1e-6  # weights and AdamW moments came back


def test_zero1_in_two_processes_matches_one_process(setup, plain):
    zero1 = _run(setup, "zero1_two", 2, *KL, "--deepspeed", "zero1")
    _check_same(plain, zero1)
    _check_grad_norm(plain, zero1)
    assert _max_diff(_params(plain / "dump"), _params(zero1 / "dump")) < 1e-4
    assert _max_diff(_params(zero1 / "dump"), _params(zero1 / "dump", 1)) == 0.0  # the ranks agree


def test_runs_in_one_process_leave_no_group_behind(setup, monkeypatch):
    """`run_train` three times in one process with no launcher (a set-up that fails after forming the group, a
    run that fails in its loop, then one that trains): each forms its one-process group and, failed or not,
    destroys it and unsets the launcher variables it set."""
    import torch.distributed as dist

    from grpokit.errors import ConfigError
    from grpokit.trainers import grpo_trainer, trainer_setup

    for key in _LAUNCHER_VARS:
        monkeypatch.delenv(key, raising=False)

    def broken(*args, **kwargs):
        assert dist.is_initialized() and os.environ["WORLD_SIZE"] == "1"  # the group the set-up formed
        raise ConfigError("broken")

    for name, where in (("twice0", "setup_rollout"), ("twice1", "GRPOTrainer._train_on_window")):
        with monkeypatch.context() as patch:
            owner, attr = (grpo_trainer.GRPOTrainer, "_train_on_window") if "." in where else (trainer_setup, where)
            patch.setattr(owner, attr, broken)
            with pytest.raises(ConfigError, match="broken"):
                _one_process(
                    _args(
                        setup.model,
                        setup.data,
                        setup.root / name,
                        setup.plugin,
                        B,
                        "--max_steps",
                        "1",
                        "--deepspeed",
                        "zero3",
                    ),
                    setup.root / f"{name}_dump",
                )
        assert not dist.is_initialized() and [k for k in _LAUNCHER_VARS if k in os.environ] == [], where
    out = setup.root / "twice2"
    _one_process(
        _args(setup.model, setup.data, out, setup.plugin, B, "--max_steps", "1", "--deepspeed", "zero2"),
        setup.root / "twice2_dump",
    )
    assert not dist.is_initialized() and [k for k in _LAUNCHER_VARS if k in os.environ] == []
    assert _log_rows(out)[0]["grad_norm"] > 0
    # DeepSpeed's comm layer started on the CPU without compiling its shared-memory kernel (zero.py)
    import deepspeed.ops

    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False
    assert "deepspeed_shm_comm" not in sys.modules
