"""Runs that meet what real runs meet, judged from outside the process: exit status, stderr (exactly one
`grpokit: error:` line and no traceback for a user's problem), the output folder's contents, and logs of a run
that was stopped and resumed equal to an uninterrupted run's with the same seed.

Every run is `python -m grpokit train` on the tiny model: 2 prompts × 4 samples per window, 2 micro-batches of 4
(`--steps_per_generation 2`: two optimizer steps per window, so step 3 is inside a window), 6 steps. The faults:
a checkpoint inside a window (save_steps 3, then kill -9), SIGTERM and Ctrl-C (once: save and stop; twice:
stop at once), a real full disk (a tmpfs the test mounts; skipped, visibly, where mounting is refused), a
read-only or blocked --output_dir, a torn trainer_state.json / log line, a corrupt optimizer file, a resume with
other options, a second run on a folder in use, and --save_total_limit -1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_process import StartedGrpokit, run_grpokit, run_grpokit_ranks
from support import flags, run_inputs

from grpokit.runs.run_dir import RunLock

pytestmark = pytest.mark.slow

PLUGIN = textwrap.dedent('''
    """Rewards and a parking callback for tests/integration/test_faults_run.py."""
    import asyncio
    import os
    import pathlib
    import time

    from grpokit.rewards import ORM, AsyncORM, orms
    from grpokit.trainers.callbacks import TrainerCallback, callbacks_map


    class LengthReward(ORM):
        """Varied scores from a random model: shorter completions score higher. From its call FAULTS_FAIL_CALL on
        it fails (a judge that went away)."""
        calls = 0

        def __call__(self, completions, **kwargs):
            LengthReward.calls += 1
            if LengthReward.calls >= int(os.environ.get("FAULTS_FAIL_CALL") or 1 << 30):
                raise ConnectionError("the judge went away")
            return [1.0 / (1 + len(c)) for c in completions]


    class SlowAsyncReward(AsyncORM):
        """An async reward that takes a while (a remote judge); says in a file that it started."""
        async def __call__(self, completions, **kwargs):
            pathlib.Path(os.environ["FAULTS_REWARD_FLAG"]).touch()

            async def one(c):
                await asyncio.sleep(2.0)
                return 1.0 / (1 + len(c))
            return list(await asyncio.gather(*(one(c) for c in completions)))


    class Park(TrainerCallback):
        """After step FAULTS_PARK_STEP: touch `parked`, then wait for `go` (or be killed); 120 s at most."""
        def on_step_end(self, trainer):
            if trainer.state.global_step == int(os.environ.get("FAULTS_PARK_STEP", "-1")):
                (trainer.output_dir / f"parked{os.environ.get('RANK', '')}").touch()
                deadline = time.monotonic() + 120
                while not (trainer.output_dir / "go").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)


    orms["len_reward"] = LengthReward
    orms["slow_async"] = SlowAsyncReward
    callbacks_map["park"] = Park
''')

WALL_CLOCK = ("timing/", "async/")


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory) -> SimpleNamespace:
    return run_inputs(tmp_path_factory.mktemp("faults"), tiny_model_dir, PLUGIN, "faults_plugin.py")


def _args(s: SimpleNamespace, out: Path, *extra: str) -> list[str]:
    return flags(
        {"--model": s.model, "--dataset": s.data, "--output_dir": out, "--external_plugins": s.plugin},
        "--tuner_type full --reward_funcs len_reward --num_generations 4 --per_device_train_batch_size 4",
        "--steps_per_generation 2 --max_completion_length 8 --max_steps 6 --learning_rate 1e-2",
        "--torch_dtype float32 --logging_steps 1 --seed 7 --disable_tqdm true --plots false",
        "--save_final_model false --save_steps 100 --log_completions true",
        *extra,
    )


def _env(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def _cli(args: list[str], timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    return run_grpokit(["train", *args], env=_env(**env), timeout=timeout)  # a forked process (cli_process.py)


def _start(args: list[str], **env: str) -> StartedGrpokit:
    return StartedGrpokit(["train", *args], env=_env(**env))  # a forked process of its own group (cli_process.py)


def _wait_for(path: Path, proc: subprocess.Popen | StartedGrpokit, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            _, err = proc.communicate()
            pytest.fail(f"run ended (rc {proc.returncode}) before {path.name}: {err[-3000:]}")
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def _finish(proc: subprocess.Popen | StartedGrpokit, timeout: float = 120) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return proc.returncode, err


def _log(out: Path, name: str = "logging.jsonl") -> list[dict]:
    rows = [json.loads(line) for line in (out / name).read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in rows]


def _one_error_line(stderr: str, *needles: str) -> str:
    assert "Traceback" not in stderr, stderr[-4000:]
    errors = [line for line in stderr.splitlines() if line.startswith("grpokit: error:")]
    assert len(errors) == 1, stderr[-4000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def _ok(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert res.returncode == 0, res.stderr[-4000:]
    assert "Traceback" not in res.stderr, res.stderr[-4000:]
    return res


def _ckpts(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))


@pytest.fixture(scope="module")
def reference(setup) -> SimpleNamespace:
    """The uninterrupted run every resumed run must equal: 6 steps, a checkpoint at step 3 (inside a window)."""
    out = setup.root / "reference"
    _ok(_cli(_args(setup, out, "--save_steps", "3")))
    log = _log(out)
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    assert len({r["loss"] for r in log}) > 1  # a signal: equal logs are not equal by accident
    return SimpleNamespace(out=out, log=log, completions=_log(out, "completions.jsonl"))


def _assert_same_as_reference(out: Path, reference: SimpleNamespace) -> None:
    assert _log(out) == reference.log
    assert _log(out, "completions.jsonl") == reference.completions  # every prompt trained once, same samples


# ----------------------------------------------------------------------------------------------------------
# resume trains the same thing
# ----------------------------------------------------------------------------------------------------------
def test_checkpoint_inside_a_window_resumes_exactly(setup, reference):
    """save_steps 3 falls inside the second window; killed after it, the resumed run trains the window's second
    micro-batch (saved with the checkpoint) and then goes on: the log equals the uninterrupted run's."""
    out = setup.root / "mid_window"
    args = _args(setup, out, "--save_steps", "3", "--callbacks", "park")
    proc = _start(args, FAULTS_PARK_STEP="3")
    _wait_for(out / "parked", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    _finish(proc)
    assert [r["step"] for r in _log(out)] == [1, 2, 3]
    assert _ckpts(out) == ["checkpoint-3"]
    assert (out / "checkpoint-3" / "window_rank0.pt").is_file()  # the untrained rest of the window
    _ok(_cli(args + ["--resume_from_checkpoint", "latest"]))  # stale lock of the killed run taken over
    _assert_same_as_reference(out, reference)


def test_sigterm_saves_then_resume_equals_uninterrupted(setup, reference):
    out = setup.root / "sigterm"
    args = _args(setup, out, "--callbacks", "park")
    proc = _start(args, FAULTS_PARK_STEP="3")
    _wait_for(out / "parked", proc)
    os.killpg(proc.pid, signal.SIGTERM)  # as SLURM and Kubernetes send it: to the whole group
    (out / "go").touch()
    rc, err = _finish(proc)
    assert rc == 143, err[-3000:]
    assert "Traceback" not in err and "grpokit: error:" not in err
    stopped = [line for line in err.splitlines() if line.startswith("grpokit: stopped:")]
    assert len(stopped) == 1 and "after step 3" in stopped[0] and "--resume_from_checkpoint latest" in stopped[0]
    assert _ckpts(out) == ["checkpoint-3"] and (out / "checkpoint-3" / "window_rank0.pt").is_file()
    lock = RunLock(out)
    lock.acquire()  # released on the way out: the kernel lock is free (the file stays, emptied)
    lock.release()
    assert (out / ".grpokit.lock").read_text() == ""
    (out / "go").unlink()
    _ok(_cli(args + ["--resume_from_checkpoint", "latest"]))
    _assert_same_as_reference(out, reference)


def test_sigterm_to_two_processes_saves_one_step_and_resumes_exactly(setup):
    """torchrun with 2 processes, SIGTERM to the whole group while rank 0 waits after step 3 (inside a window):
    the ranks agree, both save their share of the window into checkpoint-3, the resumed 2-process run equals
    an uninterrupted 2-process run."""
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "grpokit",
        "train",
    ]
    two = ("--per_device_train_batch_size", "2")
    ref = setup.root / "two_reference"
    # the reference and the resumed run: torchrun's ranks forked from the zygote (cli_process.py); the run that
    # is stopped goes through torchrun itself, whose forwarding of SIGTERM to its ranks is part of the subject
    res = run_grpokit_ranks(["train", *_args(setup, ref, *two)], 2, env=_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = setup.root / "two_sigterm"
    args = _args(setup, out, *two, "--callbacks", "park")
    proc = subprocess.Popen(
        [*launcher, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(FAULTS_PARK_STEP="3"),
        start_new_session=True,
    )
    _wait_for(out / "parked0", proc)
    os.killpg(proc.pid, signal.SIGTERM)
    (out / "go").touch()
    _, err = _finish(proc, timeout=200)
    stopped = [line for line in err.splitlines() if line.startswith("grpokit: stopped:")]
    assert len(stopped) == 1 and "after step 3" in stopped[0], err[-3000:]  # said once, by rank 0
    assert {p.name for p in (out / "checkpoint-3").glob("window_rank*.pt")} == {"window_rank0.pt", "window_rank1.pt"}
    (out / "go").unlink()
    res = run_grpokit_ranks(["train", *args, "--resume_from_checkpoint", "latest"], 2, env=_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _log(out) == _log(ref) and [r["step"] for r in _log(out)] == [1, 2, 3, 4, 5, 6]


def test_ctrl_c_once_saves_twice_stops_at_once(setup):
    """Ctrl-C while an async reward is awaited: once, the step ends and a checkpoint is saved (exit 130); twice,
    the run stops at once, no asyncio tracebacks either way."""
    for presses, ckpts in ((1, ["checkpoint-1"]), (2, [])):
        out = setup.root / f"ctrl_c_{presses}"
        flag = setup.root / f"reward_started_{presses}"
        proc = _start(_args(setup, out, "--reward_funcs", "slow_async"), FAULTS_REWARD_FLAG=str(flag))
        _wait_for(flag, proc)
        for _ in range(presses):
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.3)
        rc, err = _finish(proc)
        assert rc == 130, err[-3000:]
        assert "Traceback" not in err and "Task was destroyed" not in err and "never retrieved" not in err, err
        assert _ckpts(out) == ckpts, err
        if presses == 2:
            _one_error_line(err, "interrupted")


# ----------------------------------------------------------------------------------------------------------
# checkpoints: incomplete, torn, corrupt, abandoned
# ----------------------------------------------------------------------------------------------------------
def _copy_reference(reference, setup, name: str) -> Path:
    out = setup.root / name
    shutil.copytree(reference.out, out)
    return out


def test_latest_skips_a_torn_state_file_and_sets_newer_aside(setup, reference):
    out = _copy_reference(reference, setup, "torn_state")
    (out / "checkpoint-6" / "trainer_state.json").write_text("")  # the disk filled while it was written
    with (out / "logging.jsonl").open("a") as f:  # and the log's last line was torn
        f.write('{"step": 7, "lo')
    with (out / "completions.jsonl").open("a") as f:
        f.write('{"step": 7, "prom')
    res = _ok(_cli(_args(setup, out, "--save_steps", "3", "--resume_from_checkpoint", "latest")))
    skipped = [line for line in res.stderr.splitlines() if "skipped checkpoint-6" in line]
    assert len(skipped) == 1 and "empty" in skipped[0], res.stderr
    assert "checkpoint-6.abandoned" in _ckpts(out)  # moved aside, not deleted; `latest` never picks it
    assert "checkpoint-6" in _ckpts(out) and "checkpoint-3" in _ckpts(out)  # the resumed run's own
    _assert_same_as_reference(out, reference)


def test_resume_from_an_older_checkpoint_moves_newer_ones_aside(setup, reference):
    out = _copy_reference(reference, setup, "older")
    (out / "checkpoint-6.abandoned").mkdir()  # an earlier abandonment: this one gets the next free name
    _ok(_cli(_args(setup, out, "--save_steps", "3", "--resume_from_checkpoint", str(out / "checkpoint-3"))))
    assert _ckpts(out) == ["checkpoint-3", "checkpoint-6", "checkpoint-6.abandoned", "checkpoint-6.abandoned-2"]
    _assert_same_as_reference(out, reference)


def test_half_written_first_checkpoint_starts_fresh(setup, reference):
    """A run killed while its first checkpoint was written: `latest` finds nothing usable and starts fresh (the
    earlier-run guard does not refuse it), keeping the unusable folder aside."""
    out = setup.root / "half_first"
    out.mkdir()
    (out / "checkpoint-3").mkdir()  # a folder without its state file (a save that never finished)
    (out / "checkpoint-3" / "model.safetensors").write_bytes(b"\0" * 100)
    (out / "checkpoint-6.tmp").mkdir()  # a half-written one under the new scheme
    res = _ok(_cli(_args(setup, out, "--save_steps", "3", "--resume_from_checkpoint", "latest")))
    assert "starting fresh" in res.stderr
    assert _ckpts(out) == ["checkpoint-3", "checkpoint-3.unusable", "checkpoint-6"]
    _assert_same_as_reference(out, reference)


def test_corrupt_optimizer_file_is_one_line_naming_it(setup, reference):
    out = _copy_reference(reference, setup, "corrupt_optimizer")
    optimizer = out / "checkpoint-6" / "state" / "optimizer.bin"
    optimizer.write_bytes(b"\x00garbage" * (optimizer.stat().st_size // 8) + b"\0" * (optimizer.stat().st_size % 8))
    res = _cli(_args(setup, out, *flags("--save_steps 3 --resume_from_checkpoint latest --max_steps 8")))
    assert res.returncode == 2
    line = _one_error_line(res.stderr, "optimizer.bin", "unreadable")
    assert "random_states" not in line


def test_a_checkpoint_folder_is_data_not_code(setup, reference):
    """From outside the process: a FIFO in a checkpoint is refused in one line before the model loads (no hang);
    a planted pickle payload is refused without running; a corrupt optimizer file is named (not the RNG file); an
    RNG file that does not load stops the resume instead of being skipped; a deeply nested args.json is one line."""
    out = _copy_reference(reference, setup, "hostile")
    ckpt, marker = out / "checkpoint-6", setup.root / "payload_ran"
    resume = _args(setup, out, "--save_steps", "3", "--resume_from_checkpoint", str(ckpt), "--max_steps", "8")
    os.mkfifo(ckpt / "state" / "notes.bin")
    res = _cli(resume, timeout=60)
    assert res.returncode == 2
    _one_error_line(res.stderr, "notes.bin is a FIFO, not a regular file")
    (ckpt / "state" / "notes.bin").unlink()

    payload = f"import os; os.system('touch {marker}')"
    planted = b"cbuiltins\nexec\n(V" + payload.encode() + b"\ntR."  # a protocol-0 pickle that runs `payload`
    (ckpt / "state" / "custom_checkpoint_0.pkl").write_bytes(planted)
    res = _cli(resume)
    assert res.returncode == 2 and not marker.exists()
    _one_error_line(res.stderr, "custom_checkpoint_0.pkl would import builtins.exec", "refused without running it")
    (ckpt / "state" / "custom_checkpoint_0.pkl").unlink()
    optimizer = ckpt / "state" / "optimizer.bin"
    good = optimizer.read_bytes()
    optimizer.write_bytes(b"\0" * len(good))
    res = _cli(resume)
    assert res.returncode == 2
    line = _one_error_line(res.stderr, "optimizer.bin is unreadable")
    assert "random_states" not in line  # accelerate's RNG file reads as data: never blamed
    optimizer.write_bytes(good)

    rng = ckpt / "state" / "random_states_0.pkl"
    rng.write_bytes(b"\0" * rng.stat().st_size)  # the same size: the file list does not catch it
    res = _cli(resume)
    assert res.returncode == 2
    _one_error_line(res.stderr, "random_states_0.pkl (the RNG states) does not load")

    nested = '{"seed": ' + "[" * 2000 + "]" * 2000 + "}"  # beyond Python's recursion limit, at the same size
    args_json = ckpt / "args.json"
    args_json.write_text(nested.ljust(args_json.stat().st_size))
    res = _cli(resume, timeout=60)
    assert res.returncode == 2
    _one_error_line(res.stderr, "args.json nests deeper than 32 levels")
    assert _log(out) == reference.log  # nothing trained, nothing truncated


def test_an_error_after_a_step_saves_it_and_the_resume_trains_each_prompt_once(setup, reference):
    """The reward fails from the third window on (after step 4): the run saves checkpoint-4 with the failed
    window pending, ends with one line saying so, and the resumed run trains steps 5 and 6 on the same prompts
    as the uninterrupted run."""
    out = setup.root / "error_save"
    args = _args(setup, out, "--save_steps", "3")
    res = _cli(args, FAULTS_FAIL_CALL="3")
    assert res.returncode != 0
    saved = [line for line in res.stderr.splitlines() if "checkpoint saved in" in line]
    assert len(saved) == 1 and "after step 4" in saved[0] and "--resume_from_checkpoint latest" in saved[0], res.stderr
    assert _ckpts(out) == ["checkpoint-3", "checkpoint-4"]
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["prompts_pending"] == [4] and state["prompts_consumed"] == 6  # the failed window, drawn again
    _ok(_cli(args + ["--resume_from_checkpoint", "latest"]))
    rows = _log(out, "completions.jsonl")
    assert [r["step"] for r in _log(out)] == [1, 2, 3, 4, 5, 6]
    assert sorted((r["step"], r["prompt"]) for r in rows) == sorted(
        (r["step"], r["prompt"]) for r in reference.completions
    )


def test_resume_with_other_options_is_refused_or_warned(setup, reference):
    out = _copy_reference(reference, setup, "changed")
    before = (out / "args.json").read_text()
    res = _cli(
        _args(
            setup,
            out,
            *flags("--save_steps 3 --resume_from_checkpoint latest --seed 8 --num_generations 2"),
        )
    )
    assert res.returncode == 2
    line = _one_error_line(res.stderr, "--seed 7 → 8", "--num_generations 4 → 2")
    assert "--save_steps" not in line
    assert (out / "args.json").read_text() == before  # not overwritten
    assert _log(out) == reference.log  # nothing trained, nothing truncated
    res = _ok(
        _cli(
            _args(
                setup,
                out,
                "--save_steps",
                "3",
                "--resume_from_checkpoint",
                str(out / "checkpoint-3"),
                "--logging_steps",
                "2",
            )
        )
    )
    warned = [line for line in res.stderr.splitlines() if "--logging_steps 1 → 2" in line]
    assert len(warned) == 1, res.stderr
    assert json.loads((out / "args.json").read_text())["logging_steps"] == 2  # recorded, and said


# ----------------------------------------------------------------------------------------------------------
# disk and paths
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def tmpfs(setup, request):
    """A small tmpfs mounted for the test (root only); the test is skipped, with the reason shown, elsewhere."""
    mnt = setup.root / f"tmpfs_{request.node.name}"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        pytest.skip(f"a real full disk needs a tmpfs mount, refused here: {proc.stderr.strip()[:200]}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def test_full_disk_is_one_line_and_a_resume_after_freeing_space_equals_uninterrupted(setup, reference, tmpfs):
    """4 MB hold one checkpoint (about 2.2 MB) but not two: the save at step 6 fails with ENOSPC, the error is
    one line, the half-written checkpoint is gone and checkpoint-3 stands. Grown (space freed), the run resumes
    and its log equals the uninterrupted run's."""
    out = tmpfs / "run"
    args = _args(setup, out, "--save_steps", "3")
    res = _cli(args)
    assert res.returncode == 2, res.stderr[-3000:]
    _one_error_line(res.stderr, "No space left on device", str(out), "free space")
    assert _ckpts(out) == ["checkpoint-3"]
    assert json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3
    subprocess.run(["mount", "-o", "remount,size=32m", str(tmpfs)], check=True)
    _ok(_cli(args + ["--resume_from_checkpoint", "latest"]))
    _assert_same_as_reference(out, reference)


def test_read_only_and_blocked_output_dirs_are_one_line_before_the_model_loads(setup, tmpfs):
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    res = _cli(_args(setup, tmpfs / "run"))
    assert res.returncode == 2
    _one_error_line(res.stderr, str(tmpfs / "run"), "Read-only file system", "writable --output_dir")
    blocker = setup.root / "a_file"
    blocker.write_text("not a folder")
    res = _cli(_args(setup, blocker / "run"))  # a file where a folder of the path should be
    assert res.returncode == 2
    _one_error_line(res.stderr, str(blocker), "--output_dir", "Not a directory")


def test_a_second_run_on_a_folder_in_use_is_refused(setup):
    out = setup.root / "in_use"
    args = _args(setup, out, "--callbacks", "park", "--max_steps", "2")
    first = _start(args, FAULTS_PARK_STEP="1")
    try:
        _wait_for(out / "parked", first)
        res = _cli(args)
        assert res.returncode == 2
        _one_error_line(res.stderr, f"in use by pid {first.pid}")
        (out / "go").touch()
        rc, err = _finish(first)
        assert rc == 0, err[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert [r["step"] for r in _log(out)] == [1, 2]  # each step once: the refused run wrote nothing


def test_save_total_limit_minus_one_keeps_everything(setup):
    out = setup.root / "keep_all"
    _ok(
        _cli(
            _args(
                setup,
                out,
                *flags("--save_steps 2 --save_total_limit -1 --save_final_model true --learning_rate 3e-7"),
            )
        )
    )
    assert _ckpts(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert (out / "final_model" / "model.safetensors").is_file()
    # 6 significant digits, not 6 decimals (which logged 0.0): the linear schedule: 3e-7 × (6 - step) / 6
    assert [r["learning_rate"] for r in _log(out)] == [float(f"{3e-7 * (6 - s) / 6:.6g}") for s in range(1, 7)]
