"""The test zygote (cli_process.py) gives what a fresh ``python`` process gives where the suite relies on it: exit
statuses, stdout/stderr, the environment and folder, atexit handlers and non-daemon threads at exit, torchrun's
environment for a launcher's ranks (which then form a real gloo group), CPU pinning, and a started process that
can be polled, signalled and waited for."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time

import pytest
from cli_process import StartedGrpokit, _the_zygote, run_grpokit, run_grpokit_ranks

pytestmark = pytest.mark.slow


def _script(tmp_path, body: str):
    path = tmp_path / "child.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def _one(tmp_path, body: str, *args: str, env: dict | None = None):
    """``python child.py ARGS`` in one forked process (the path of ``run_grpokit``: no module teardown)."""
    (done,) = _the_zygote().run(list(args), [dict(env or os.environ)], str(tmp_path), 60, _script(tmp_path, body))
    return done


@pytest.mark.parametrize(
    ("body", "code", "in_stderr"),
    [
        ("import sys; sys.exit(3)", 3, ""),
        ("import sys; sys.exit('no good')", 1, "no good"),
        ("raise ValueError('boom')", 1, "ValueError: boom"),
        ("import os; os._exit(5)", 5, ""),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9, ""),
        ("print('fine')", 0, ""),
    ],
    ids=["sys.exit(3)", "sys.exit(str)", "exception", "os._exit", "SIGKILL", "return"],
)
def test_exit_statuses_are_a_plain_interpreters(tmp_path, body, code, in_stderr):
    done = _one(tmp_path, body)
    assert done.returncode == code, done.stderr
    assert in_stderr in done.stderr


def test_environment_folder_atexit_and_threads_at_exit(tmp_path):
    """The job's variables and folder; at exit a non-daemon thread is waited for, then the atexit handlers run and
    buffered output is flushed, as a normal interpreter exit does."""
    body = """
        import atexit, os, sys, threading, time
        print(os.environ["ZYGOTE_PROBE"], os.getcwd(), os.getpgid(0) == os.getpid())
        def late():
            time.sleep(0.3)
            sys.stdout.write("thread done\\n")
        threading.Thread(target=late).start()
        atexit.register(lambda: sys.stdout.write("atexit ran\\n"))
        sys.stdout.write("unflushed ")
        sys.exit(0)
    """
    done = _one(tmp_path, body, env={**os.environ, "ZYGOTE_PROBE": "seen"})
    assert done.returncode == 0, done.stderr
    first, *rest = done.stdout.splitlines()
    assert first == f"seen {tmp_path} True"
    assert rest == ["unflushed thread done", "atexit ran"]


def test_ranks_get_torchruns_environment_and_form_a_group(tmp_path):
    body = """
        import os, sys
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
        print(*(os.environ[k] for k in keys), int(t), sorted(os.sched_getaffinity(0)), sys.argv[1])
        dist.destroy_process_group()
    """
    cpu = min(os.sched_getaffinity(0))
    done = run_grpokit_ranks(["arg"], 2, timeout=120, script=_script(tmp_path, body), cpus=[cpu])
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"0 0 2 2 127.0.0.1 3 [{cpu}] arg", f"1 1 2 2 127.0.0.1 3 [{cpu}] arg"]


def test_a_failing_rank_fails_the_launch(tmp_path):
    body = "import os, sys; sys.exit(7 if os.environ['RANK'] == '1' else 0)"
    assert run_grpokit_ranks([], 2, timeout=60, script=_script(tmp_path, body)).returncode == 7


def test_grpokit_itself_answers_through_the_zygote(tmp_path):
    done = run_grpokit(["frobnicate"], cwd=str(tmp_path))
    assert done.returncode != 0 and "unknown command 'frobnicate'" in done.stderr


def test_a_started_process_is_polled_signalled_and_waited_for(tmp_path):
    (tmp_path / "logging.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    proc = StartedGrpokit(["view", str(tmp_path), "--serve", "--port", "0"], env=dict(os.environ))
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "report.html").exists():  # written before it starts serving
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)  # serving: it runs until it is stopped
        assert proc.poll() is None and os.getpgid(proc.pid) == proc.pid  # a group of its own
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -9
    assert out.splitlines()[0] == str(tmp_path / "report.html")  # printed (and flushed) before serving
