"""Run untrusted Python in a sandbox that the kernel enforces (see ``isolation.py`` for the layers).

``run_job(code, stdin, limits)`` runs one program once with ``stdin`` as its input (stdio mode). ``Session``
runs one program and then answers the grader's calls on it (call mode, see ``grader.py``): the parent sends
``{"q", "src", "a"}`` lines, one at a time, and reads each answer before it decides what to send next. Nothing is
written to the host's file system: the harness and the job travel on a pipe, results come back on another.

Every run takes a slot (its own uid when the trainer is root). When the run ends, the sandbox's PID namespace is
gone: the parent kills its init through a pidfd and waits for it, and a namespace's init exits only after
everything else in it has. Why a run failed is decided here, from what the parent saw (its own deadline, bytes it
counted, the CPU time and peak memory the kernel reports for the child), never from an exit code or a report the
program can choose.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from grpokit.rewards import isolation, seccomp_filter
from grpokit.rewards.isolation import live_sandbox_processes  # noqa: F401 (part of this module's API)
from grpokit.rewards.sandbox_io import Collector
from grpokit.rewards.sandbox_result import SandboxLimits, SandboxResult  # noqa: F401 (part of this module's API)

logger = logging.getLogger(__name__)

HARNESS = Path(__file__).with_name("_sandbox_child.py").read_text(encoding="utf-8")
BOOT = (
    "import json,sys;F=open(int(sys.argv[1]),'rb');J=json.loads(F.readline());"
    "exec(compile(J.pop('harness'),'_sandbox_child.py','exec'),{'__name__':'__sandbox__','JOB':J,'JOB_FILE':F})"
)
STARTUP_ALLOWANCE_S = 0.5  # wall-clock time granted on top of the timeout for the sandbox to start


class _Slots:
    """Lowest free slot number; a slot is held for the length of one run."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.used: set[int] = set()

    def acquire(self) -> int:
        with self.lock:
            slot = next(i for i in range(len(self.used) + 1) if i not in self.used)
            self.used.add(slot)
            return slot

    def release(self, slot: int) -> None:
        with self.lock:
            self.used.discard(slot)


_SLOTS = _Slots()


def _cpu_seconds(limits: SandboxLimits) -> int:
    return max(1, math.ceil(limits.timeout_s))


def _job(code: str, serve: bool, limits: SandboxLimits, rt: isolation.Runtime, report_fd: int,
         uid: int | None) -> bytes:  # fmt: skip
    lim = {
        "cpu_s": _cpu_seconds(limits),
        "mem_bytes": int(limits.memory_mb) << 20,
        "fsize_bytes": limits.max_file_bytes,
        "nofile": limits.max_open_files,
        "nproc": limits.max_processes,
    }
    iso = rt.mode == "bwrap"
    job = {"harness": HARNESS, "code": code, "serve": serve, "limits": lim, "report_fd": report_fd,
           "late_filter": seccomp_filter.late_filter().hex() if iso else None,
           "tmpfs": {"size": limits.max_disk_bytes, "nr_inodes": limits.max_inodes} if iso else None,
           "drop_uid": uid if rt.privileged else None}  # fmt: skip
    return json.dumps(job).encode() + b"\n"


class Session:
    """One sandboxed run of ``code``. ``serve=False``: fed ``stdin``, run to its end (``result()``).
    ``serve=True``: after the program ran, ``call(src, args)`` asks for one value at a time; ``result()`` ends it.
    ``deadline`` (``time.monotonic()``) caps the run on top of ``limits.timeout_s``, so that several runs of one
    sample share one time budget."""

    def __init__(self, code: str, limits: SandboxLimits, rt: isolation.Runtime, stdin: str = "",
                 serve: bool = False, deadline: float | None = None) -> None:  # fmt: skip
        self.limits, self.rt, self.serve = limits, rt, serve
        self.slot = _SLOTS.acquire()
        self.fds: list[int] = []
        self.workdir = tempfile.mkdtemp(prefix="grpokit-sbx-") if rt.mode == "none" else None
        self.out: Collector | None = None
        self._result: SandboxResult | None = None
        self.calls = 0
        try:
            self._spawn(code, stdin, deadline)
        except BaseException:
            self._release()
            raise

    def _pipe(self) -> tuple[int, int]:
        r, w = os.pipe()
        self.fds += [r, w]
        return r, w

    def _close(self, *which: int) -> None:
        for fd in which:
            os.close(fd)
            self.fds.remove(fd)

    def _spawn(self, code: str, stdin: str, deadline: float | None) -> None:
        rt, limits, uid = self.rt, self.limits, self.rt.slot_uid(self.slot)
        job_r, job_w = self._pipe()
        rep_r, rep_w = self._pipe()
        child_fds = [job_r, rep_w]
        argv, ids = isolation.drop_to(rt, uid)
        status_r = None
        if rt.mode == "bwrap":
            sc_r, sc_w = self._pipe()
            os.write(sc_w, seccomp_filter.main_filter())  # a few hundred bytes: fits the pipe buffer
            self._close(sc_w)
            status_r, status_w = self._pipe()
            child_fds += [sc_r, status_w]
            argv += isolation.bwrap_args(rt, uid, limits.max_disk_bytes, sc_r, status_w)
        argv += [rt.python, "-I", "-S", "-B", "-X", "utf8", "-c", BOOT, str(job_r)]
        home = self.workdir or "/tmp"
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home}
        if self.workdir and uid is not None:
            os.chown(self.workdir, uid, uid)
        start = time.monotonic()
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=child_fds, start_new_session=True, cwd=self.workdir or "/", env=env,
                                **ids)  # fmt: skip
        self._close(*child_fds)
        end = start + limits.timeout_s + STARTUP_ALLOWANCE_S
        self.out = Collector(proc, limits, min(end, deadline) if deadline is not None else end, rep_r, status_r)
        self.start = start
        for fd in (job_w, status_r, rep_r):  # the collector closes these; a second close could hit another thread's fd
            if fd is not None:
                self.fds.remove(fd)
        self.job_w = job_w
        self.out.adopt_writer(job_w)
        self.out.adopt_writer(self.out.stdin_fd)
        self.out.send(job_w, _job(code, self.serve, limits, rt, rep_w, uid))
        self.out.send(proc.stdin.fileno(), stdin.encode(), close=True)
        if not self.serve:  # the harness waits at its end for the job pipe to close: its peak is read first
            self.out.pump(lambda: self.out.done)
            self.out.read_peak()
            self.out.close_writer_after(job_w)
            self.out.pump(lambda: False)
        else:
            self.out.pump(lambda: self.out.ready or self.out.program_failed)

    @property
    def ready(self) -> bool:
        """Call mode: the program ran to its end and the harness waits for calls."""
        return self.out is not None and self.out.ready and not self.out.program_failed and self.out.alive()

    def call(self, src: str, args: list) -> dict | None:
        """The harness's answer (``{"v"}``, ``{"ref"}`` or ``{"err", "mro"}``) to one call; None when the run is
        over (deadline, output limit, the process gone) or the answer did not parse."""
        if not self.ready:
            return None
        self.calls += 1
        q = self.calls
        self.out.await_q = q
        self.out.send(self.job_w, json.dumps({"q": q, "src": src, "a": args}).encode() + b"\n")
        self.out.pump(lambda: self.out.answer is not None or self.out.rep_r not in self.out.reading)
        answer, self.out.answer, self.out.await_q = self.out.answer, None, None
        return answer if isinstance(answer, dict) else None

    def result(self) -> SandboxResult:
        if self._result is None:
            try:
                if self.out is not None and self.out.alive():
                    self.out.read_peak()
                    self.out.close_writer_after(self.job_w)
                    self.out.pump(lambda: False)
            finally:
                try:
                    if self.out is not None:
                        self.out.reap()
                finally:
                    self._release()
            self._result = self.out.result()
            self._result.elapsed_s = time.monotonic() - self.start
        return self._result

    def _release(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        _SLOTS.release(self.slot)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.result()


def run_job(code: str, stdin: str = "", limits: SandboxLimits | None = None, rt: isolation.Runtime | None = None,
            deadline: float | None = None) -> SandboxResult:  # fmt: skip
    """Run ``code`` once, fed ``stdin`` (stdio mode)."""
    return Session(code, limits or SandboxLimits(), rt or isolation.resolve("bwrap"), stdin, False, deadline).result()


def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None,
               isolation_mode: str = "bwrap") -> SandboxResult:  # fmt: skip
    """Run ``code`` fed ``stdin`` in the ``isolation_mode`` sandbox."""
    return run_job(code, stdin=stdin, limits=limits, rt=isolation.resolve(isolation_mode))


def _trial(rt: isolation.Runtime) -> str | None:
    """None when ``rt`` runs a program, else the reason it does not (one line)."""
    try:
        res = run_job("print(6 * 7)", limits=SandboxLimits(timeout_s=20), rt=rt)
    except OSError as exc:
        return str(exc)
    if res.status == "ok" and res.stdout.strip() == "42":
        return None
    return (res.stderr.strip().splitlines() or [f"status {res.status}"])[-1][:300]


@functools.lru_cache(maxsize=4)
def ready(isolation_mode: str = "bwrap") -> isolation.Runtime:
    """The runtime for ``isolation_mode`` after one trial run; IsolationUnavailable (one line) when it fails.
    As root without unprivileged user namespaces, falls back to running bubblewrap as root (see isolation.py)."""
    rt = isolation.resolve(isolation_mode)
    why = _trial(rt)
    if why is not None and rt.mode == "bwrap" and rt.as_root:
        fallback = dataclasses.replace(rt, privileged=True)
        if _trial(fallback) is None:
            logger.info(
                "code sandbox: no user namespaces for unprivileged uids (%s); bubblewrap runs as root and "
                "each program drops to its slot uid",
                why,
            )
            return fallback
    if why is not None:
        raise isolation.IsolationUnavailable(
            f"code_exec: the {isolation_mode} sandbox does not start on this host: {why}{isolation.hint_for(why)}"
        )
    return rt


def sandbox_layers(isolation_mode: str = "bwrap") -> dict[str, object]:
    """Which protections are active on this host (for logs and docs); raises IsolationUnavailable."""
    return isolation.describe(ready(isolation_mode))
