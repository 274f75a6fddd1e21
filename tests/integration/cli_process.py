"""``python -m grpokit ...`` for the tests, as a real process that skips the interpreter's import of torch,
transformers and grpokit: a zygote process imports them once (per test process), then forks one child per call.

Each child is a process of its own, as ``subprocess.run([sys.executable, "-m", "grpokit", ...])`` gives: its own
pid, process group, environment, working directory, stdout/stderr (files read back as text), exit status
(``sys.exit``, ``os._exit``, a signal) and atexit handlers; nothing it does reaches the zygote or the next call.
What it shares is the modules imported before the fork, so a variable read only at import time (none that these
tests vary) keeps the zygote's value; ``OMP_NUM_THREADS`` is applied with ``torch.set_num_threads``. A run whose
zygote cannot fork safely (a thread is already running there) falls back to a plain subprocess.

How a child ends: a one-process child that returns or raises SystemExit waits for its non-daemon threads, runs
its atexit handlers, flushes stdout/stderr and leaves with its status, without the interpreter's teardown of the
modules (1.6-2 s of CPU in a process holding torch, transformers, peft and deepspeed, more than a failing run's
whole work); any other exception ends it as a plain interpreter would. The ranks of ``run_grpokit_ranks`` (a
launcher's processes, forked together, each with the environment torchrun gives it) end with the full
finalization, since a clean exit of a multi-process run is one of the things their tests check.

Only for runs whose subject is not the interpreter's start-up itself (``--help`` answering before torch is
imported: those tests start ``sys.executable`` themselves).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

ZYGOTE = textwrap.dedent("""
    import json, os, runpy, sys, threading
    import grpokit.cli.main
    grpokit.cli.main._quiet_third_party()  # what `grpokit train|infer` sets before the libraries are imported
    import importlib.util
    import torch, transformers  # noqa: F401  (what every call would import)
    import grpokit.pipeline.train, grpokit.pipeline.infer, grpokit.server.cli  # noqa: F401
    # and what a run imports on its way (peft pulls transformers' modelling and torch._dynamo: 1.9 s of each
    # child's 2.5 s in a one-step run; accelerate imports deepspeed where it is installed)
    import accelerate, datasets, peft, safetensors.torch, transformers.optimization  # noqa: F401
    if importlib.util.find_spec("deepspeed") is not None:
        import deepspeed  # noqa: F401
    if importlib.util.find_spec("vllm") is not None:  # the vLLM suite's environment: 3 s of each engine's start
        import vllm  # noqa: F401
    reply = os.fdopen(int(sys.argv[1]), "w", buffering=1)


    def answer(**message):
        reply.write(json.dumps(message) + "\\n")


    def reap_monitors():
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    return
            except ChildProcessError:
                return


    def monitor(job):
        # a started process (Popen-like): this fork of the zygote starts the child, answers its pid and writes
        # its exit status to a file once it ends, while the zygote goes on with the next job
        pid = os.fork()
        if pid == 0:
            return job["procs"][0]
        try:
            answer(pids=[pid])
            reply.close()
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            with open(job["status"] + ".part", "w") as f:
                f.write(str(code))
            os.replace(job["status"] + ".part", job["status"])
        finally:  # whatever happens, this fork never goes back to the zygote's loop
            os._exit(0)


    def child_of(job):
        # the proc this process is to become, or None in the zygote once the job is answered
        reap_monitors()
        if threading.active_count() != 1:  # a thread would be missing in the child, holding its locks
            answer(unsafe=threading.active_count())
            return None
        if job.get("status"):
            return monitor(job) if os.fork() == 0 else None
        pids = []
        for proc in job["procs"]:  # one process, or a launcher's ranks (started together: they meet in a group)
            pid = os.fork()
            if pid == 0:
                return proc
            pids.append(pid)
        answer(pids=pids)
        answer(codes=[os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids])
        return None


    for line in sys.stdin:
        job = json.loads(line)
        proc = child_of(job)
        if proc is not None:
            break
    else:
        raise SystemExit(0)
    # the child: become `python -m grpokit ARGS` (or `python SCRIPT ARGS`) with the job's environment and files
    reply.close()
    os.setpgid(0, 0)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(proc["env"])
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, proc["stdout"], os.O_WRONLY | os.O_APPEND),
                           (2, proc["stderr"], os.O_WRONLY | os.O_APPEND)):  # appending: one file may take both
        f = os.open(path, mode)
        os.dup2(f, fd)
        os.close(f)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if proc.get("cpus"):  # `taskset -c CPUS`
        os.sched_setaffinity(0, proc["cpus"])
    script, finalize = job.get("script"), job.get("finalize", True)
    sys.argv = [script or "grpokit", *job["args"]]
    del job, proc, reply, line


    def run():
        if script:
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
        else:
            runpy.run_module("grpokit", run_name="__main__", alter_sys=True)


    if finalize:
        run()
    else:  # the interpreter's exit up to its atexit handlers, then out without tearing the modules down
        try:
            run()
            code = 0
        except SystemExit as stop:
            code = 0 if stop.code is None else stop.code
            if not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
        threading._shutdown()  # non-daemon threads are waited for, as at a normal exit
        import atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code & 0xFF)
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

    def run(
        self,
        args: list[str],
        envs: list[dict],
        cwd: str,
        timeout: float,
        script: str | None = None,
        cpus: list[int] | None = None,
    ) -> list[subprocess.CompletedProcess] | None:
        """One child per environment, started together (``python -m grpokit ARGS``, or ``python SCRIPT ARGS``),
        each on ``cpus`` if given; None when the zygote cannot fork safely."""
        with self.lock, tempfile.TemporaryDirectory(prefix="grpokit-cli-") as tmp:
            procs = [
                {
                    "env": env,
                    "stdout": os.path.join(tmp, f"stdout{i}"),
                    "stderr": os.path.join(tmp, f"stderr{i}"),
                    "cpus": cpus,
                }
                for i, env in enumerate(envs)
            ]
            for proc in procs:
                for path in (proc["stdout"], proc["stderr"]):
                    open(path, "w").close()
            job = {"args": args, "cwd": cwd, "procs": procs, "script": script, "finalize": len(envs) > 1}
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            first = json.loads(self.replies.readline())
            if "pids" not in first:
                return None
            timer = threading.Timer(timeout, _kill_groups, (first["pids"],))
            timer.start()
            try:
                codes = json.loads(self.replies.readline())["codes"]
            finally:
                timer.cancel()
            cmd = _command(args, script)
            done = [
                subprocess.CompletedProcess(cmd, code, *(_read(proc[k]) for k in ("stdout", "stderr")))
                for code, proc in zip(codes, procs, strict=True)
            ]
            if _timed_out(timer):
                raise subprocess.TimeoutExpired(
                    cmd, timeout, output="".join(d.stdout for d in done), stderr="".join(d.stderr for d in done)
                )
            return done

    def start(self, args: list[str], env: dict, cwd: str, status: str, stdout: str, stderr: str) -> int | None:
        """A child started and left running (its exit status written to ``status`` when it ends); its pid, or
        None when the zygote cannot fork safely or is busy with a run."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            proc = {"env": env, "stdout": stdout, "stderr": stderr}
            job = {"args": args, "cwd": cwd, "procs": [proc], "status": status, "finalize": False}
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            return json.loads(self.replies.readline()).get("pids", [None])[0]
        finally:
            self.lock.release()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def _command(args: list[str], script: str | None = None) -> list[str]:
    """The command line a child stands for: ``python -m grpokit ARGS`` or ``python SCRIPT ARGS``."""
    return [sys.executable, *([script] if script else ["-m", "grpokit"]), *args]


def _kill_groups(pids: list[int]) -> None:
    threading.current_thread().fired = True
    for pid in pids:
        try:
            os.killpg(pid, 9)
        except ProcessLookupError:
            pass


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _timed_out(timer: threading.Timer) -> bool:
    return getattr(timer, "fired", False)


_zygote: _Zygote | None = None


def _the_zygote() -> _Zygote:
    global _zygote
    if _zygote is None or _zygote.proc.poll() is not None:
        _zygote = _Zygote()
        atexit.register(_zygote.close)
    return _zygote


def run_grpokit(
    args: list[str], *, env: dict | None = None, cwd: str | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", "grpokit", *args], capture_output=True, text=True, timeout=...)``,
    from the zygote."""
    done = _the_zygote().run(list(args), [dict(os.environ if env is None else env)], cwd or os.getcwd(), timeout)
    if done is None:
        return subprocess.run(_command(args), capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    return done[0]


def launch_env(env: dict, rank: int, nproc: int, port: int) -> dict:
    """The environment torchrun gives rank ``rank`` of ``nproc`` on one node (static rendezvous at
    127.0.0.1:port, rank 0 hosting the store, no restarts)."""
    return {
        **env,
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_grpokit_ranks(
    args: list[str],
    nproc: int,
    port: int | None = None,
    *,
    env: dict | None = None,
    timeout: float = 240,
    script: str | None = None,
    cpus: list[int] | None = None,
) -> subprocess.CompletedProcess:
    """What ``torchrun --nproc_per_node NPROC --master_addr 127.0.0.1 --master_port PORT -m grpokit ARGS`` runs
    (or ``torchrun ... SCRIPT ARGS``; every rank on ``cpus``, as under ``taskset -c``):
    NPROC ranks with torchrun's environment (``launch_env``), forked from the zygote together (each skips the
    imports, and no launcher process starts). Its status is non-zero when a rank fails, as torchrun's is (here
    the first failing rank's own status, where torchrun exits 1); its outputs are the ranks', one after the other
    in rank order. The launcher itself (its signal forwarding, its exit report) is tested with real torchrun
    where it is the subject (test_clean_exit.py, test_faults_run.py's SIGTERM to two processes)."""
    base = dict(os.environ if env is None else env)
    port = free_port() if port is None else port
    envs = [launch_env(base, rank, nproc, port) for rank in range(nproc)]
    cmd = _command(args, script)
    done = _the_zygote().run(list(args), envs, os.getcwd(), timeout, script, cpus)
    if done is None:  # the zygote could not fork safely: plain processes, started together
        pin = ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []
        procs = [
            subprocess.Popen([*pin, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
            for e in envs
        ]
        outputs = [p.communicate(timeout=timeout) for p in procs]
        done = [subprocess.CompletedProcess(cmd, p.returncode, *out) for p, out in zip(procs, outputs, strict=True)]
    return subprocess.CompletedProcess(
        cmd,
        next((d.returncode for d in done if d.returncode != 0), 0),
        "".join(d.stdout for d in done),
        "".join(d.stderr for d in done),
    )


class StartedGrpokit:
    """``subprocess.Popen([sys.executable, "-m", "grpokit", *args], stdout=PIPE, stderr=PIPE, text=True,
    start_new_session=True)`` as far as these tests use it (``pid``, ``poll``, ``wait``, ``communicate``,
    ``send_signal``, ``kill``, ``returncode``), for a child of the zygote: its outputs go to files, read back by
    ``communicate``; the process is its own group, so ``os.killpg(proc.pid, sig)`` reaches it as a session
    would."""

    def __init__(self, args: list[str], env: dict, cwd: str | None = None, output: str | None = None) -> None:
        """``output``: one file for both streams (``stdout=sink, stderr=STDOUT``); ``communicate`` then reads
        nothing."""
        self.args = _command(args)
        self._tmp = tempfile.TemporaryDirectory(prefix="grpokit-cli-")
        self._status, self._out, self._err = (os.path.join(self._tmp.name, n) for n in ("status", "stdout", "stderr"))
        if output is not None:
            self._out = self._err = output
        for path in {self._out, self._err}:
            open(path, "w").close()
        self.returncode: int | None = None
        self._popen: subprocess.Popen | None = None
        pid = _the_zygote().start(list(args), env, cwd or os.getcwd(), self._status, self._out, self._err)
        if pid is None:  # a plain process instead
            with open(self._out, "a") as out, open(self._err, "a") as err:
                self._popen = subprocess.Popen(
                    self.args, stdout=out, stderr=err, env=env, cwd=cwd, start_new_session=True
                )
            pid = self._popen.pid
        self.pid = pid

    def poll(self) -> int | None:
        if self.returncode is None:
            if self._popen is not None:
                self.returncode = self._popen.poll()
            elif os.path.exists(self._status):
                with open(self._status) as f:
                    self.returncode = int(f.read())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        if self._out == self._err:
            return "", ""
        return _read(self._out), _read(self._err)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(9)

    def terminate(self) -> None:
        self.send_signal(15)
