"""``python -m grpokit ...`` for the tests, as a real process that skips the interpreter's import of torch,
transformers and grpokit: a zygote process imports them once (per test process), then forks one child per call.

Each child is a process of its own, as ``subprocess.run([sys.executable, "-m", "grpokit", ...])`` gives: its own
pid, environment, working directory, stdout/stderr (files read back as text), exit status (``sys.exit``,
``os._exit``, a signal), atexit handlers and interpreter finalization; nothing it does reaches the zygote or the
next call. What it shares is the modules imported before the fork, so a variable read only at import time (none
that these tests vary) keeps the zygote's value; ``OMP_NUM_THREADS`` is applied with ``torch.set_num_threads``.
A run whose zygote cannot fork safely (a thread is already running there) falls back to a plain subprocess.

Only for runs whose subject is not the interpreter's start-up itself (``--help`` answering before torch is
imported, the clean exit of lingering process groups: those tests start ``sys.executable`` themselves).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading

ZYGOTE = textwrap.dedent("""
    import json, os, runpy, sys, threading
    import grpokit.cli.main
    grpokit.cli.main._quiet_third_party()  # what `grpokit train|infer` sets before the libraries are imported
    import torch, transformers  # noqa: F401  (what every call would import)
    import grpokit.pipeline.train, grpokit.pipeline.infer  # noqa: F401
    reply = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    for line in sys.stdin:
        job = json.loads(line)
        if threading.active_count() != 1:  # a thread would be missing in the child, holding its locks
            reply.write(json.dumps({"unsafe": threading.active_count()}) + "\\n")
            continue
        pid = os.fork()
        if pid == 0:
            break
        reply.write(json.dumps({"pid": pid}) + "\\n")
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\\n")
    else:
        raise SystemExit(0)
    # the child: become `python -m grpokit ARGS` with the job's environment, folder and files
    reply.close()
    os.setpgid(0, 0)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, job["stdout"], os.O_WRONLY),
                           (2, job["stderr"], os.O_WRONLY)):
        f = os.open(path, mode)
        os.dup2(f, fd)
        os.close(f)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.argv = ["grpokit", *job["args"]]
    del job, reply, line
    runpy.run_module("grpokit", run_name="__main__", alter_sys=True)
""")


class _Zygote:
    def __init__(self) -> None:
        read, write = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, str(write)],
            stdin=subprocess.PIPE,
            pass_fds=(write,),
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        os.close(write)
        self.replies = os.fdopen(read, "r")
        self.lock = threading.Lock()

    def run(self, args: list[str], env: dict, cwd: str, timeout: float) -> subprocess.CompletedProcess | None:
        with self.lock, tempfile.TemporaryDirectory(prefix="grpokit-cli-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            for path in (out, err):
                open(path, "w").close()
            self.proc.stdin.write(
                json.dumps({"args": args, "env": env, "cwd": cwd, "stdout": out, "stderr": err}) + "\n"
            )
            self.proc.stdin.flush()
            first = json.loads(self.replies.readline())
            if "pid" not in first:
                return None
            timer = threading.Timer(timeout, _kill_group, (first["pid"],))
            timer.start()
            try:
                code = json.loads(self.replies.readline())["code"]
            finally:
                timer.cancel()
            cmd = [sys.executable, "-m", "grpokit", *args]
            stdout, stderr = (open(p, encoding="utf-8", errors="replace").read() for p in (out, err))
            if _timed_out(timer):
                raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
            return subprocess.CompletedProcess(cmd, code, stdout, stderr)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def _kill_group(pid: int) -> None:
    threading.current_thread().fired = True
    try:
        os.killpg(pid, 9)
    except ProcessLookupError:
        pass


def _timed_out(timer: threading.Timer) -> bool:
    return getattr(timer, "fired", False)


_zygote: _Zygote | None = None


def run_grpokit(
    args: list[str], *, env: dict | None = None, cwd: str | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", "grpokit", *args], capture_output=True, text=True, timeout=...)``,
    from the zygote."""
    global _zygote
    if _zygote is None or _zygote.proc.poll() is not None:
        _zygote = _Zygote()
        atexit.register(_zygote.close)
    done = _zygote.run(list(args), dict(os.environ if env is None else env), cwd or os.getcwd(), timeout)
    if done is None:
        return subprocess.run(
            [sys.executable, "-m", "grpokit", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
        )
    return done
