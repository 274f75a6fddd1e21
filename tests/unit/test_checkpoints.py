"""The run-lifecycle pieces alone: checkpoint folders (sealed, checked, skipped, set aside, rotated), the window
a checkpoint is taken inside, the resume's argument check, the run folder's probe, lock and OS-error lines,
signals, async work left by an exception, torn log lines and the 6-significant-digit rounding."""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import logging
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from grpokit import aio
from grpokit.errors import ConfigError
from grpokit.runs import checkpoints as ck
from grpokit.runs.outputs import JsonlLog, MetricsAccumulator, round_significant
from grpokit.runs.run_args import check_resume_args
from grpokit.runs.run_dir import (
    LOCK_FILE,
    OutputDirError,
    RunLock,
    atomic_write_text,
    os_error_line,
    output_errors,
    prepare_output_dir,
)
from grpokit.runs.stops import RunStopped, StopRequest, stop_outside_the_loop
from grpokit.trainers.batch import RolloutBatch
from grpokit.trainers.state import WindowProgress


def _checkpoint(out, step: int, **extra):
    """A sealed checkpoint-N with a state folder and a weights file, as RunOutputs writes one."""
    ckpt = out / f"checkpoint-{step}"
    tmp = ck.temporary_dir(ckpt)
    (tmp / "state").mkdir(parents=True)
    (tmp / "state" / "optimizer.bin").write_bytes(b"o" * 64)
    save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
    ck.finish_checkpoint(tmp, ckpt, {"global_step": step, "prompts_consumed": 2 * step, "max_steps": 9, **extra})
    return ckpt


# ----------------------------------------------------------------------------------------------------------
# checkpoint folders
# ----------------------------------------------------------------------------------------------------------
def test_a_sealed_checkpoint_lists_its_files_and_checks_them(tmp_path):
    ckpt = _checkpoint(tmp_path, 2)
    assert not (tmp_path / "checkpoint-2.tmp").exists()
    state = ck.check_checkpoint(ckpt)
    size = (ckpt / "model.safetensors").stat().st_size
    assert state["files"] == {"model.safetensors": size, "state/optimizer.bin": 64}
    assert state["global_step"] == 2
    (ckpt / "state" / "optimizer.bin").write_bytes(b"o" * 10)  # truncated after the seal
    with pytest.raises(ConfigError, match=r"state/optimizer.bin has 10 bytes, 64 were written"):
        ck.check_checkpoint(ckpt)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="model.safetensors is missing"):
        ck.check_checkpoint(ckpt)


@pytest.mark.parametrize(
    "content, why",
    [
        (None, "no trainer_state.json"),
        ("", "is empty"),
        ('{"global_step": 3, "pro', "not valid JSON"),
        ('["x"]', "holds a JSON list, not a grpokit trainer state"),
        ('{"prompts_consumed": 1}', "lacks global_step"),
        ('{"global_step": "3", "prompts_consumed": 1}', 'global_step is "3", not a step count'),
        ('{"global_step": -1, "prompts_consumed": 1}', "global_step is -1, not a step count"),
        ('{"global_step": true, "prompts_consumed": 1}', "global_step is true, not a step count"),
        ('{"global_step": 1e400, "prompts_consumed": 1}', "global_step is Infinity, not a step count"),
        ('{"global_step": 2, "prompts_consumed": 4, "files": {"../../etc/passwd": 1}}', "files is"),
        ('{"global_step": 2, "prompts_consumed": 4, "files": {"/etc/passwd": 1}}', "files is"),
        ('{"global_step": 2, "prompts_consumed": 4, "prompts_pending": [9]}', "not yet drawn"),
        ('{"global_step": 2, "prompts_consumed": 4, "prompts_pending": "x"}', "prompts_pending is"),
        ('{"global_step": 2, "prompts_consumed": 4, "window_processes": 0}', "window_processes is 0"),
        ('{"global_step": 2, "prompts_consumed": 4, "x": ' + "[" * 5000 + "]" * 5000 + "}", "nests deeper"),
        ('{"global_step": 2, "prompts_consumed": 4, "x": ' + "[" * 40 + "]" * 40 + "}", "nests deeper"),
        (b'{"global_step": 2, "prompts_consumed": 4, "x": "\xff"}', "not UTF-8"),
    ],
)
def test_latest_skips_unusable_checkpoints_and_says_why(tmp_path, content, why):
    _checkpoint(tmp_path, 2)
    bad = _checkpoint(tmp_path, 4)
    if content is None:
        (bad / ck.STATE_FILE).unlink()
    else:
        (bad / ck.STATE_FILE).write_bytes(content if isinstance(content, bytes) else content.encode())
    found, skipped = ck.latest_checkpoint(tmp_path)
    assert found == tmp_path / "checkpoint-2"
    assert [(p.name, why in reason) for p, reason in skipped] == [("checkpoint-4", True)]
    assert ck.skipped_line(skipped).startswith("--resume_from_checkpoint latest: skipped checkpoint-4 (")
    with pytest.raises(ConfigError, match=rf"--resume_from_checkpoint {bad}: .*{why}.*'latest'"):
        ck.resolve_resume(tmp_path, str(bad))


def test_a_failed_seal_leaves_no_checkpoint_and_the_old_one_stands(tmp_path, monkeypatch):
    """The disk fills exactly while trainer_state.json is written: nothing named checkpoint-4 appears."""
    _checkpoint(tmp_path, 2)
    ckpt = tmp_path / "checkpoint-4"
    tmp = ck.temporary_dir(ckpt)
    (tmp / "state").mkdir(parents=True)

    def full(path, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(ck, "atomic_write_text", full)
    with pytest.raises(OSError):
        ck.finish_checkpoint(tmp, ckpt, {"global_step": 4, "prompts_consumed": 8})
    assert not ckpt.exists()
    assert ck.latest_checkpoint(tmp_path) == (tmp_path / "checkpoint-2", [])
    ck.remove_leftovers(tmp_path)
    assert not tmp.exists()


def test_saving_a_step_again_replaces_the_checkpoint_whole(tmp_path):
    _checkpoint(tmp_path, 3)
    again = _checkpoint(tmp_path, 3, note="second")
    assert ck.read_state(again)["note"] == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]


def test_newer_checkpoints_are_set_aside_not_deleted(tmp_path):
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    (tmp_path / "checkpoint-6.abandoned").mkdir()
    moved = ck.set_aside_newer(tmp_path, 2)
    assert sorted(p.name for p in moved) == ["checkpoint-4.abandoned", "checkpoint-6.abandoned-2"]
    assert [p.name for p in ck.checkpoint_dirs(tmp_path)] == ["checkpoint-2"]
    assert ck.latest_checkpoint(tmp_path)[0] == tmp_path / "checkpoint-2"
    (tmp_path / "checkpoint-2.replaced").mkdir()  # not set aside: a save's own scratch name
    assert sorted(p.name for p in ck.set_aside_dirs(tmp_path)) == [
        "checkpoint-4.abandoned",
        "checkpoint-6.abandoned",
        "checkpoint-6.abandoned-2",
    ]


@pytest.mark.parametrize("limit, kept", [(None, [2, 4, 6]), (-1, [2, 4, 6]), (0, [2, 4, 6]), (2, [4, 6]), (1, [6])])
def test_rotation_keeps_all_for_none_zero_or_negative_and_never_the_new_one(tmp_path, limit, kept):
    for step in (2, 4, 6):
        _checkpoint(tmp_path, step)
    ck.rotate(tmp_path, limit, keep=tmp_path / "checkpoint-6")
    assert [ck.checkpoint_step(p) for p in ck.checkpoint_dirs(tmp_path)] == kept


def test_a_load_failure_names_the_unreadable_file(tmp_path):
    ckpt = _checkpoint(tmp_path, 2)
    torch.save({"lr": 1.0}, ckpt / "state" / "scheduler.bin")
    (ckpt / "state" / "optimizer.bin").write_bytes(b"\x00not a torch file")
    err = ck.load_error(ckpt, RuntimeError("PytorchStreamReader failed reading zip archive"))
    assert "optimizer.bin is unreadable" in str(err) and "\n" not in str(err)
    torch.save({"x": 1}, ckpt / "state" / "optimizer.bin")
    err = ck.load_error(ckpt, KeyError("param_groups"))
    assert "loading it failed (KeyError" in str(err)


# ----------------------------------------------------------------------------------------------------------
# the window a checkpoint is taken inside
# ----------------------------------------------------------------------------------------------------------
def _batch(rows: int, seed: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (rows, 6), generator=g)
    return RolloutBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=torch.arange(6).repeat(rows, 1),
        completion_mask=torch.ones(rows, 3),
        truncated=torch.zeros(rows, dtype=torch.bool),
        advantages=torch.randn(rows, generator=g),
        old_logps=torch.randn(rows, 3, generator=g),
        num_items=7.0,
        extra={"tag": torch.arange(rows)},
    )


def test_an_unfinished_window_is_saved_and_resumes_where_it_stopped(tmp_path):
    micro = [_batch(2, 0), _batch(2, 1)]
    window = WindowProgress.of(micro, num_iterations=2, metrics={"reward": 0.5})
    it = window.remaining()
    trained = [next(it), next(it), next(it)]  # 3 of 2 × 2 micro-steps
    assert trained == [micro[0], micro[1], micro[0]] and window.unfinished
    acc = MetricsAccumulator()
    acc.add({"loss": torch.tensor(0.25)})
    window.save(tmp_path, rank=0, step_metrics=acc.state())
    restored = MetricsAccumulator()
    again = WindowProgress.load(tmp_path, 0, restored)
    assert again is not None and again.done == 3
    assert again.metrics == {"reward": 0.5}
    rest = list(again.remaining())
    assert len(rest) == 1 and torch.equal(rest[0].input_ids, micro[1].input_ids)
    assert torch.equal(rest[0].extra["tag"], micro[1].extra["tag"]) and rest[0].num_items == 7.0
    assert restored.pop() == {"loss": 0.25}
    assert WindowProgress.load(tmp_path, 1, MetricsAccumulator()) is None  # another rank's file: none


def test_a_finished_window_saves_nothing_and_a_damaged_one_is_one_line(tmp_path):
    window = WindowProgress.of([_batch(2, 0)], num_iterations=1, metrics={})
    list(window.remaining())
    window.save(tmp_path, 0, {})
    assert not list(tmp_path.iterdir())
    (tmp_path / "window_rank0.pt").write_bytes(b"torn")
    with pytest.raises(ConfigError, match=r"window_rank0.pt is unreadable .*earlier checkpoint"):
        WindowProgress.load(tmp_path, 0, MetricsAccumulator())


# ----------------------------------------------------------------------------------------------------------
# the resume's arguments
# ----------------------------------------------------------------------------------------------------------
def test_resume_refuses_options_that_change_what_trains_and_lists_harmless_ones(tmp_path):
    old = {
        "seed": 7,
        "num_generations": 4,
        "dataset": ["a.jsonl"],
        "logging_steps": 1,
        "save_steps": 3,
        "only_old": 1,
        "resume_from_checkpoint": None,
    }
    same = dict(old, only_new=2, resume_from_checkpoint="latest")
    assert check_resume_args(old, same, tmp_path) == []  # options one side lacks are not compared
    harmless = dict(old, logging_steps=5, save_steps=10)
    assert check_resume_args(old, harmless, tmp_path) == ["--logging_steps 1 → 5", "--save_steps 3 → 10"]
    with pytest.raises(ConfigError) as err:
        check_resume_args(old, dict(old, seed=8, dataset=["b.jsonl"], logging_steps=2), tmp_path)
    line = str(err.value)
    assert '--dataset ["a.jsonl"] → ["b.jsonl"]' in line and "--seed 7 → 8" in line
    assert "logging_steps" not in line and "\n" not in line
    assert check_resume_args(None, same, tmp_path) == []  # a checkpoint without args.json: nothing to compare


# ----------------------------------------------------------------------------------------------------------
# the run folder
# ----------------------------------------------------------------------------------------------------------
def test_output_dir_is_created_probed_and_blocked_paths_are_one_line(tmp_path):
    out = prepare_output_dir(tmp_path / "a" / "b")
    assert out.is_dir() and list(out.iterdir()) == []  # the probe file is gone
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for path in (blocker, blocker / "run"):
        with pytest.raises(OutputDirError) as err:
            prepare_output_dir(path)
        assert str(blocker) in str(err.value) and "folder" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "exc, needle",
    [
        (OSError(errno.ENOSPC, "No space left on device", "/o/x"), "No space left on device [errno 28]; free space"),
        (OSError(errno.EROFS, "Read-only file system"), "read-only: choose a writable --output_dir"),
        (OSError(errno.EACCES, "Permission denied"), "fix the folder's permissions"),
        (RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })"), "[errno 28]"),
    ],
)
def test_os_errors_become_one_line_with_path_errno_and_advice(exc, needle):
    line = os_error_line(exc, "/o", "writing")
    assert line.startswith("--output_dir: writing /o") and needle in line and "\n" not in line


def test_output_errors_pass_other_exceptions_through(tmp_path):
    with pytest.raises(ValueError), output_errors(tmp_path, "writing"):
        raise ValueError("not the disk")
    with pytest.raises(OutputDirError, match="Permission denied"), output_errors(tmp_path, "writing"):
        raise PermissionError(errno.EACCES, "Permission denied")


def test_atomic_write_leaves_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "args.json"
    atomic_write_text(path, "old")

    def boom(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError):
        atomic_write_text(path, "new")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["args.json"]


_LOCK_RACER = """
import os, sys, time
from grpokit.runs.run_dir import OutputDirError, RunLock
root, start, trials, racers = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for k in range(trials):  # trial k: every racer tries folder k at the same moment
    folder = f"{root}/t{k}"
    time.sleep(max(0.0, start + 0.2 * k - time.time()))
    lock = RunLock(folder)
    try:
        lock.acquire()
    except OutputDirError as e:
        print(k, "refused", e, flush=True)
        open(f"{folder}/tried-{os.getpid()}", "w").close()
        continue
    print(k, "held", flush=True)
    open(f"{folder}/tried-{os.getpid()}", "w").close()
    deadline = time.time() + 30  # the winner holds the lock until every racer has tried
    while sum(n.startswith("tried-") for n in os.listdir(folder)) < racers and time.time() < deadline:
        time.sleep(0.01)
    lock.release()
"""


def test_racing_processes_take_the_lock_one_at_a_time_and_a_dead_one_frees_it(tmp_path):
    """The kernel's lock: in every synchronised trial exactly one of four processes holds it, the others get
    the in-use line (most folders start with the lock file of a run that died); after a holder is killed
    (SIGKILL, no clean-up) the next run takes the lock without a word."""
    import time

    trials = 16
    for k in range(trials):
        (tmp_path / f"t{k}").mkdir()
        if k % 4:  # a dead run's lock file, where the old pid-file lock's takeover raced
            (tmp_path / f"t{k}" / LOCK_FILE).write_text(json.dumps({"pid": 999999, "host": os.uname().nodename}))
    start = time.time() + 1.5  # the racers' start-up (a torch-free import) is done by then
    cmd = [sys.executable, "-c", _LOCK_RACER, str(tmp_path), str(start), str(trials), "4"]
    racers = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(4)]
    lines = [line.split(" ", 2) for r in racers for line in r.communicate(timeout=120)[0].splitlines()]
    for k in range(trials):
        verdicts = sorted(v for t, v, *_ in lines if t == str(k))
        assert verdicts == ["held", "refused", "refused", "refused"], (k, lines)
    assert all("is in use by" in rest[0] for _, v, *rest in lines if v == "refused")
    (tmp_path / "again" / "t0").mkdir(parents=True)
    holder = subprocess.Popen(  # holds until a second racer tries, which none does: until it is killed
        [sys.executable, "-c", _LOCK_RACER, str(tmp_path / "again"), str(time.time()), "1", "2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    folder = tmp_path / "again" / "t0"
    try:
        assert holder.stdout.readline().strip() == "0 held"
        with pytest.raises(OutputDirError, match=rf"in use by pid {holder.pid}: wait"):
            RunLock(folder).acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(folder)
    lock.acquire()  # its holder was killed: the kernel released the lock
    with pytest.raises(OutputDirError, match=rf"in use by pid {os.getpid()}"):
        RunLock(folder).acquire()  # a second run in this very process (two TRL-API trainers) is refused too
    assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    lock.acquire()  # released and taken again by the same process
    lock.release()


def test_a_lock_path_that_is_not_a_regular_file_is_refused(tmp_path):
    os.mkfifo(tmp_path / LOCK_FILE)
    with pytest.raises(OutputDirError, match="not a regular file"):
        RunLock(tmp_path).acquire()


# ----------------------------------------------------------------------------------------------------------
# signals, async work, logs
# ----------------------------------------------------------------------------------------------------------
def test_first_signal_is_recorded_and_a_second_ctrl_c_raises(capsys):
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
        assert "SIGTERM: finishing the current optimizer step" in capsys.readouterr().err
        stopped = stop.stopped(signal.SIGTERM, 3, "out/checkpoint-3")
        assert stopped.exit_code == 143 and "--resume_from_checkpoint latest" in str(stopped)
        stop.signum = None
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_sigterm_outside_the_loop_stops_at_once_with_143():
    with pytest.raises(RunStopped) as err, stop_outside_the_loop():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()  # not reached: the handler raised
    assert err.value.exit_code == 143 and "nothing was saved" in str(err.value)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    stop = StopRequest()
    with stop_outside_the_loop():
        stop.install()  # the loop's own handler inside it, the outer one back after it
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM
        stop.restore()
        os.kill(os.getpid(), signal.SIGTERM)  # a launcher repeating it while the stopped run exits: ignored
    with pytest.raises(RunStopped), stop_outside_the_loop():  # a new run: a SIGTERM stops it again
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()


def test_run_sync_left_by_an_exception_cancels_and_collects_every_task(caplog):
    started, cancelled = [], []

    async def slow(i):
        started.append(i)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def failing():
        await asyncio.sleep(0.01)
        raise KeyboardInterrupt  # Ctrl-C landing in one trajectory's task

    async def rollout():
        return await asyncio.gather(*(slow(i) for i in range(5)), failing())

    with caplog.at_level(logging.ERROR, logger="asyncio"), pytest.raises(KeyboardInterrupt):
        aio.run_sync(rollout())
    assert sorted(cancelled) == sorted(started) == list(range(5))
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage() or "destroyed" in r.getMessage()]

    async def fine():
        return 3

    assert aio.run_sync(fine()) == 3  # the loop is still usable


def test_background_loops_are_cancelled_from_another_thread():
    loop = aio.LoopThread("test-loop")
    try:
        fut = loop.submit(asyncio.sleep(30))
        aio.cancel_background_work()
        with pytest.raises(BaseException) as err:
            fut.result(timeout=10)
        assert isinstance(err.value, asyncio.CancelledError | __import__("concurrent").futures.CancelledError)
    finally:
        loop.close()


def test_torn_last_log_line_is_dropped_and_a_bad_middle_line_named(tmp_path):
    path = tmp_path / "logging.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo')
    log = JsonlLog(path)
    assert [r["step"] for r in log.rows()] == [1, 2, 3]  # the torn line is not a row
    assert log.truncate_after(2) == 1
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    path.write_text('{"step": 1}\n\xff garbage\n{"step": 2}\n')
    with pytest.raises(ConfigError, match=r"logging.jsonl: line 2 is not a JSON object"):
        log.truncate_after(2)


def test_a_row_holding_unicode_line_separators_stays_one_line(tmp_path):
    # a tiny random model's byte-level BPE writes U+0085 now and then; json.dumps leaves it raw, and
    # str.splitlines() (the way most scripts read a JSON-lines file) then cut the row in two
    text = "a\x85b\u2028c\u2029d é\nend"
    path = tmp_path / "completions.jsonl"
    log = JsonlLog(path)
    log.write({"step": 1, "completion": text})
    log.write({"step": 2, "completion": "plain"})
    log.close()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["completion"] for line in lines] == [text, "plain"]
    assert "é" in lines[0]  # text outside ASCII stays readable, only the three separators are escaped


@pytest.mark.parametrize(
    "value, want", [(3e-7, 3e-7), (0.123456789, 0.123457), (1234567.0, 1234570.0), (-2.5e-12, -2.5e-12), (0.0, 0.0)]
)
def test_logged_values_keep_six_significant_digits(value, want):
    assert round_significant(value) == want


def test_non_finite_values_stay_as_they_are():
    assert round_significant(float("inf")) == float("inf")
    assert round_significant(float("nan")) != round_significant(float("nan"))


def test_a_checkpoint_inside_a_window_resumes_with_as_many_processes(tmp_path):
    ckpt = _checkpoint(tmp_path, 3, window_processes=2)
    state = ck.read_state(ckpt)
    ck.check_window_processes(state, 2, ckpt)
    with pytest.raises(ConfigError, match=r"by 2 process\(es\).*resumed with 1; resume it with 2"):
        ck.check_window_processes(state, 1, ckpt)
    ck.check_window_processes(ck.read_state(_checkpoint(tmp_path, 4)), 1, ckpt)  # at a window boundary: any
