"""Run untrusted Python in a sandbox that the kernel enforces (see ``isolation.py`` for the layers).

``run_job(code, stdin, steps, limits)`` runs one program once: in stdio mode (``steps=None``) with ``stdin`` as its
input, in step mode followed by the grader's set-up and expression steps (see ``grader.py``). Nothing is written
to the host's file system: the harness and the job travel on a pipe, results come back on another.

Every run takes a slot (its own uid when the trainer is root). When the call returns, the sandbox's PID namespace
is gone: the parent kills its init through a pidfd and waits for it, and a namespace's init exits only after
everything else in it has.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import select
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from grpokit.rewards import grader, isolation, seccomp_filter
from grpokit.rewards.isolation import live_sandbox_processes  # noqa: F401 (part of this module's API)
from grpokit.rewards.sandbox_result import SandboxLimits, SandboxResult, classify  # noqa: F401 (SandboxLimits: API)

logger = logging.getLogger(__name__)

HARNESS = Path(__file__).with_name("_sandbox_child.py").read_text(encoding="utf-8")
BOOT = (
    "import json,sys;J=json.loads(open(int(sys.argv[1]),'rb').read());"
    "exec(compile(J.pop('harness'),'_sandbox_child.py','exec'),{'__name__':'__sandbox__','JOB':J})"
)
REAP_WAIT_S = 5.0  # how long bwrap gets to reap the sandbox's init after the kill
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


def _job(code: str, steps: list | None, limits: SandboxLimits, rt: isolation.Runtime, report_fd: int,
         uid: int | None) -> bytes:  # fmt: skip
    lim = {
        "cpu_s": max(1, math.ceil(limits.timeout_s)),
        "mem_bytes": int(limits.memory_mb) << 20,
        "fsize_bytes": limits.max_file_bytes,
        "nofile": limits.max_open_files,
        "nproc": limits.max_processes,
    }
    exec_bpf = seccomp_filter.exec_filter().hex() if rt.mode == "bwrap" else None
    job = {"harness": HARNESS, "code": code, "steps": steps, "limits": lim, "exec_filter": exec_bpf,
           "report_fd": report_fd, "drop_uid": uid if rt.privileged else None}  # fmt: skip
    return json.dumps(job).encode()


def run_job(
    code: str, stdin: str = "", steps: list | None = None, limits: SandboxLimits | None = None,
    rt: isolation.Runtime | None = None,
) -> SandboxResult:  # fmt: skip
    limits = limits or SandboxLimits()
    rt = rt or isolation.resolve("bwrap")
    slot = _SLOTS.acquire()
    fds: list[int] = []
    workdir = tempfile.mkdtemp(prefix="grpokit-sbx-") if rt.mode == "none" else None
    try:
        return _spawn_and_collect(code, stdin, steps, limits, rt, rt.slot_uid(slot), fds, workdir)
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        _SLOTS.release(slot)


def _pipe(fds: list[int]) -> tuple[int, int]:
    r, w = os.pipe()
    fds += [r, w]
    return r, w


def _close(fds: list[int], *which: int) -> None:
    for fd in which:
        os.close(fd)
        fds.remove(fd)


def _spawn_and_collect(code, stdin, steps, limits, rt, uid, fds, workdir) -> SandboxResult:
    job_r, job_w = _pipe(fds)
    rep_r, rep_w = _pipe(fds)
    child_fds = [job_r, rep_w]
    argv, ids = isolation.drop_to(rt, uid)
    status_r = None
    if rt.mode == "bwrap":
        sc_r, sc_w = _pipe(fds)
        os.write(sc_w, seccomp_filter.main_filter())  # a few hundred bytes: fits the pipe buffer
        _close(fds, sc_w)
        status_r, status_w = _pipe(fds)
        child_fds += [sc_r, status_w]
        argv += isolation.bwrap_args(rt, uid, limits.max_disk_bytes, sc_r, status_w)
    argv += [rt.python, "-I", "-S", "-B", "-X", "utf8", "-c", BOOT, str(job_r)]
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir or "/tmp", "TMPDIR": workdir or "/tmp"}
    if workdir and uid is not None:
        os.chown(workdir, uid, uid)
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            pass_fds=child_fds, start_new_session=True, cwd=workdir or "/", env=env, **ids)  # fmt: skip
    _close(fds, *child_fds)
    out = _Collector(proc, limits, start, rep_r, status_r)
    for fd in (job_w, status_r):  # the collector closes these two; a second close could hit another thread's fd
        if fd is not None:
            fds.remove(fd)
    try:
        out.run({job_w: _job(code, steps, limits, rt, rep_w, uid), proc.stdin.fileno(): stdin.encode()})
    finally:
        out.reap()
    result = out.result()
    result.elapsed_s = time.monotonic() - start
    return result


class _Collector:
    """Feeds the child's input pipes, reads its outputs under a deadline, then makes sure it is all gone."""

    def __init__(self, proc, limits: SandboxLimits, start: float, rep_r: int, status_r: int | None) -> None:
        self.proc, self.limits, self.status_r = proc, limits, status_r
        self.deadline = start + limits.timeout_s + STARTUP_ALLOWANCE_S
        self.bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(), rep_r: bytearray()}
        self.status = bytearray()
        self.timed_out = self.too_much = False
        self.pidfd: int | None = None

    def run(self, writes: dict[int, bytes]) -> None:
        sel = selectors.DefaultSelector()
        for fd in self.bufs:
            sel.register(fd, selectors.EVENT_READ)
        if self.status_r is not None:
            sel.register(self.status_r, selectors.EVENT_READ)
        for fd in writes:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_WRITE)
        pending = {fd: memoryview(data) for fd, data in writes.items()}
        try:
            self._loop(sel, pending)
            if self.status_r is None and not (self.timed_out or self.too_much):  # no status pipe: wait for exit
                try:
                    self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.timed_out = True
        finally:
            sel.close()
            for fd in pending:
                self._close_writer(fd)

    def _close_writer(self, fd: int) -> None:
        if fd == self.proc.stdin.fileno():
            self.proc.stdin.close()
        else:
            os.close(fd)

    def _loop(self, sel, pending: dict[int, memoryview]) -> None:
        """Until the deadline, or until every output is at EOF and the child has exited: bwrap's status pipe
        closes only when bwrap exits (the sandboxed program never holds it), so a program that closes its
        outputs and keeps running is still waited for, and then counts as a timeout."""
        reading = set(self.bufs) | ({self.status_r} if self.status_r is not None else set())
        while reading:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.timed_out = True
                return
            for key, _ in sel.select(timeout=remaining):
                fd = key.fd
                if fd in pending:
                    if not self._write(fd, pending):
                        sel.unregister(fd)
                    continue
                chunk = os.read(fd, 65536)
                if fd == self.status_r:
                    self.status += chunk
                    self._watch_child()
                if not chunk:
                    sel.unregister(fd)
                    reading.discard(fd)
                    continue
                if fd == self.status_r:
                    continue
                self.bufs[fd] += chunk
                if len(self.bufs[fd]) > self.limits.max_output_bytes:
                    self.too_much = True
                    return

    def _write(self, fd: int, pending: dict[int, memoryview]) -> bool:
        """Write what the pipe takes; False (and the pipe closed) when done or the reader is gone."""
        try:
            n = os.write(fd, pending[fd][:65536])
            pending[fd] = pending[fd][n:]
        except (BrokenPipeError, BlockingIOError) as exc:
            if isinstance(exc, BlockingIOError):
                return True
            pending[fd] = memoryview(b"")
        if len(pending[fd]):
            return True
        del pending[fd]
        self._close_writer(fd)
        return False

    def _watch_child(self) -> None:
        """Hold a pidfd on the sandbox's init (from bwrap's status line) so it can be killed without pid reuse."""
        if self.pidfd is not None:
            return
        docs = _json_docs(bytes(self.status))
        if any("exit-code" in d for d in docs):
            return  # already over: bwrap reaped it
        for doc in docs:
            if "child-pid" in doc:
                try:
                    self.pidfd = os.pidfd_open(int(doc["child-pid"]))
                except (OSError, ValueError):
                    pass

    def reap(self) -> None:
        """Kill the sandbox's init (its whole PID namespace dies with it) and let bwrap reap it: killing bwrap
        first would leave the init to the host's pid 1, which in a container may never reap it."""
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=REAP_WAIT_S if self.pidfd is not None else 0)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # not reaped yet, so the group id is still ours
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()
        if self.pidfd is not None:  # the init of a PID namespace exits only after all its other processes
            poller = select.poll()
            poller.register(self.pidfd, select.POLLIN)
            poller.poll(int(REAP_WAIT_S * 1000))
            os.close(self.pidfd)
        if self.status_r is not None:
            os.close(self.status_r)

    def result(self) -> SandboxResult:
        out, err, rep = (bytes(b) for b in self.bufs.values())
        return classify(self.proc.returncode, out, err, rep, self.timed_out, self.too_much, self.limits)


def _json_docs(data: bytes) -> list[dict]:
    docs, dec, text, i = [], json.JSONDecoder(), data.decode("utf-8", "replace"), 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return docs
        try:
            doc, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return docs
        if isinstance(doc, dict):
            docs.append(doc)


def run_python(
    code: str, stdin: str = "", tests: str | None = None, limits: SandboxLimits | None = None,
    isolation_mode: str = "bwrap",
) -> SandboxResult:  # fmt: skip
    """Run ``code`` fed ``stdin``; or, with ``tests`` (assert statements), grade it (``asserts_passed``)."""
    rt = isolation.resolve(isolation_mode)
    if tests is None:
        return run_job(code, stdin=stdin, limits=limits, rt=rt)
    plan = grader.plan_asserts(tests)
    res = run_job(code, steps=plan.steps, limits=limits, rt=rt)
    if res.status == "ok":
        res.asserts_passed = grader.passed_asserts(plan, res.steps)
    return res


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
            logger.info("code sandbox: no user namespaces for unprivileged uids (%s); bubblewrap runs as root and "
                        "each program drops to its slot uid", why)
            return fallback
    if why is not None:
        raise isolation.IsolationUnavailable(f"code_exec: the {isolation_mode} sandbox does not start on this host: "
                                             f"{why}{isolation.hint_for(why)}")
    return rt


def sandbox_layers(isolation_mode: str = "bwrap") -> dict[str, object]:
    """Which protections are active on this host (for logs and docs); raises IsolationUnavailable."""
    return isolation.describe(ready(isolation_mode))
