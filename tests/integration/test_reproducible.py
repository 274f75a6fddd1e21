"""One seed, one result; one torchrun, one model.

- `torchrun --nproc_per_node 2 -m grpokit train` on a machine without a GPU (no --use_cpu) trains one model in
  one gloo group: both ranks end with the same parameters and every step is logged once.
- Two runs with the same --seed write the same logging.jsonl (timing keys aside) and end with the same
  parameters: full weights and LoRA, in 1 process and in 2 (torchrun).

The runs sample from the tiny model (the in-process engine) and score with a length reward, so the loss and the
updates depend on the seed. A callback plugin writes each rank's parameter digest before and after training, named
by the launcher's RANK (a rank left out of the group still says which process it was). 4 two-process runs
(torchrun's ranks, forked with its environment: ``_torchrun``); OMP_NUM_THREADS=1 keeps the arithmetic independent
of the thread count.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_process import run_grpokit_ranks
from support import flags, run_inputs

from grpokit.errors import ConfigError

PLUGIN = textwrap.dedent('''
    """A length reward and per-rank parameter digests, for tests/integration/test_reproducible.py."""
    import hashlib
    import json
    import os

    from grpokit.rewards import ORM, orms
    from grpokit.trainers.callbacks import TrainerCallback, callbacks_map


    class LengthReward(ORM):
        """Varied scores from a random model: shorter completions score higher."""
        def __call__(self, completions, **kwargs):
            return [1.0 / (1 + len(c)) for c in completions]


    def digest(model) -> str:
        h = hashlib.sha256()
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()


    class ParamDigest(TrainerCallback):
        def on_train_begin(self, trainer):
            self.begin = digest(trainer.policy)

        def on_train_end(self, trainer):
            row = {"begin": self.begin, "end": digest(trainer.policy),
                   "num_processes": trainer.accelerator.num_processes}
            path = os.path.join(trainer.args.output_dir, f"digest_rank{os.environ.get('RANK', '0')}.json")
            with open(path, "w") as f:
                json.dump(row, f)


    orms["len_reward"] = LengthReward
    callbacks_map["param_digest"] = ParamDigest
''')

LORA = ("--tuner_type", "lora", "--lora_rank", "4", "--lora_dropout", "0.1")
WALL_CLOCK = ("timing/", "async/")  # log keys that measure time, not training


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory) -> SimpleNamespace:
    return run_inputs(tmp_path_factory.mktemp("repro"), tiny_model_dir, PLUGIN, "repro_plugin.py")


def _args(s: SimpleNamespace, out: Path, *extra: str) -> list[str]:
    """3 steps of 1 prompt × 4 samples per process; a high learning rate so that every step moves the weights."""
    return flags(
        {"--model": s.model, "--dataset": s.data, "--output_dir": out, "--external_plugins": s.plugin},
        "--tuner_type full --reward_funcs len_reward --callbacks param_digest --num_generations 4",
        "--per_device_train_batch_size 4 --max_completion_length 8 --max_steps 3 --learning_rate 1e-2",
        "--torch_dtype float32 --logging_steps 1 --seed 7 --disable_tqdm true --plots false",
        "--save_final_model false --save_steps 100",
        *extra,
    )


def _torchrun(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 -m grpokit train ...`: its 2 ranks with torchrun's environment, forked from
    the test zygote (test_distributed.py's ``_torchrun``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = run_grpokit_ranks(["train", *args], 2, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _one_process(args: list[str]) -> None:
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_train(parse_train_args(args))
    finally:
        torch.set_num_threads(threads)


def _log(out: Path) -> list[dict]:
    """logging.jsonl without the keys that measure wall-clock time."""
    rows = [json.loads(line) for line in (out / "logging.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in rows]


def _digests(out: Path, nproc: int) -> list[dict]:
    return [json.loads((out / f"digest_rank{r}.json").read_text()) for r in range(nproc)]


def _assert_same_run(a: Path, b: Path, nproc: int) -> None:
    log_a, log_b = _log(a), _log(b)
    assert [r["step"] for r in log_a] == [1, 2, 3]
    assert len({r["loss"] for r in log_a}) > 1  # the runs have a signal: equal logs are not equal by accident
    assert log_a == log_b
    (first, *others), (second, *_) = _digests(a, nproc), _digests(b, nproc)
    assert first["end"] != first["begin"]  # training moved the weights
    assert first == second  # the same initial weights (LoRA init included) and the same final ones
    assert all(d == first for d in others)  # every rank holds the same model


@pytest.fixture(scope="module")
def full_two(setup) -> SimpleNamespace:
    """2 processes, full weights: as launched on a CPU-only machine (no --use_cpu), and with --use_cpu true."""
    bare, flagged = setup.root / "full_bare", setup.root / "full_flag"
    proc = _torchrun(_args(setup, bare))
    _torchrun(_args(setup, flagged, "--use_cpu", "true"))
    return SimpleNamespace(bare=bare, flagged=flagged, output=proc.stdout + proc.stderr)


@pytest.mark.slow
def test_torchrun_without_use_cpu_trains_one_model(full_two):
    assert full_two.output.count("no GPU: training on CPU in one gloo group") == 1  # said once, by rank 0
    r0, r1 = _digests(full_two.bare, 2)
    assert r0["num_processes"] == r1["num_processes"] == 2
    assert r0["end"] != r0["begin"]
    assert r0["end"] == r1["end"]  # DDP averaged the gradients: the ranks hold one model, not two copies
    assert [r["step"] for r in _log(full_two.bare)] == [1, 2, 3]  # each step logged once, by rank 0


@pytest.mark.slow
def test_two_process_full_runs_repeat(full_two):
    _assert_same_run(full_two.bare, full_two.flagged, 2)


@pytest.mark.slow
def test_two_process_lora_runs_repeat(setup):
    first, second = setup.root / "lora2_a", setup.root / "lora2_b"
    _torchrun(_args(setup, first, *LORA))
    _torchrun(_args(setup, second, *LORA))
    _assert_same_run(first, second, 2)


@pytest.mark.slow
@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_one_process_runs_repeat(setup, tuner):
    extra = LORA if tuner == "lora" else ()
    first, second = setup.root / f"{tuner}1_a", setup.root / f"{tuner}1_b"
    _one_process(_args(setup, first, *extra))
    _one_process(_args(setup, second, *extra))
    _assert_same_run(first, second, 1)


# ----------------------------------------------------------------------------------------------------------
# the launch checks alone (no launch)
# ----------------------------------------------------------------------------------------------------------
def test_processes_left_out_of_a_group_are_refused(monkeypatch):
    from accelerate.utils import DistributedType

    from grpokit.distributed.processes import check_backend

    args = SimpleNamespace(deepspeed=None, fsdp=False)
    alone = SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1, device=torch.device("mps"))
    check_backend(alone, args)  # one process, launched alone: fine
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"started 2 processes .* add --use_cpu true"):
        check_backend(alone, args)
    check_backend(
        SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=2, device=torch.device("cpu")), args
    )


def test_cpu_is_chosen_for_a_launch_without_accelerators(monkeypatch):
    from grpokit.distributed import processes as distributed

    monkeypatch.setattr(distributed, "has_accelerator", lambda: False)
    flag, no_flag = SimpleNamespace(use_cpu=True), SimpleNamespace(use_cpu=False)
    assert distributed.use_cpu(flag) and not distributed.use_cpu(no_flag)  # one process: as given
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.use_cpu(no_flag)  # several, no GPU: one gloo group
    monkeypatch.setattr(distributed, "has_accelerator", lambda: True)
    assert not distributed.use_cpu(no_flag)  # on GPUs accelerate forms the group itself
