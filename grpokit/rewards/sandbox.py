"""Run untrusted Python in a local sandbox: a throwaway directory, OS limits, no network, an audit hook.

Layers, outermost first (each one that the host allows; ``sandbox_layers()`` says which are active):

1. ``unshare --net`` (when running as root): the child gets an empty network namespace.
2. A fresh session (``start_new_session``); on timeout or too much output the whole process group is killed.
3. Limits set in the child before the code runs: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), file size
   (RLIMIT_FSIZE), open files (RLIMIT_NOFILE), processes (RLIMIT_NPROC), no core dumps. Pipe reads are capped.
4. When running as root: the child drops to uid/gid 65534 (nobody) after setting the limits, so RLIMIT_NPROC
   holds and file permissions apply. The interpreter must be readable by nobody; if the project's interpreter is
   not (e.g. under /root), a system ``python3`` is used for the child, which then has the standard library only.
5. A Python audit hook refuses sockets and name lookups, process creation (fork, exec, spawn, system, Popen),
   signals to other processes, raising limits, ctypes, and writes/renames/deletes outside the working directory.

Limits are set in the child (``_sandbox_child.py``) rather than in ``preexec_fn``: the parent calls this from a
thread pool, and ``preexec_fn`` is not safe in a threaded parent.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

CHILD_SCRIPT = str(Path(__file__).with_name("_sandbox_child.py"))
NOBODY = 65534
STARTUP_ALLOWANCE_S = 0.5  # wall-clock time granted on top of the timeout for the interpreter to start
_STDLIB_PROBE = "import os, sys; assert sys.version_info >= (3, 8); print(os.path.dirname(os.__file__))"
FAILURE_KINDS = ("timeout", "memory", "blocked", "output_limit", "crash", "error")


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0
    memory_mb: int = 512
    max_output_bytes: int = 1 << 20  # per stream (stdout, stderr)
    max_file_bytes: int = 16 << 20
    max_open_files: int = 64
    max_processes: int = 64  # RLIMIT_NPROC counts threads of the uid, across all sandboxes at once


@dataclass
class SandboxResult:
    status: str  # "ok" or one of FAILURE_KINDS
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None
    asserts_passed: set[int] = field(default_factory=set)
    blocked: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class _Runtime:
    python: str
    drop_uid: int | None
    prefix: tuple[str, ...]  # e.g. ("unshare", "--net", "--")


def _reachable_by_others(path: str, need: int) -> bool:
    """True when every directory above ``path`` is searchable by others and ``path`` has the ``need`` bits."""
    p = Path(path)
    try:
        if not p.stat().st_mode & need:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in p.parents)
    except OSError:
        return False


def _stdlib_of(python: str) -> str | None:
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        return os.path.dirname(os.__file__)
    try:
        out = subprocess.run(
            [python, "-I", "-S", "-c", _STDLIB_PROBE],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def _runtime() -> _Runtime:
    if os.name != "posix":
        raise OSError("the code sandbox needs Linux (resource limits, process groups)")
    if os.geteuid() != 0:
        return _Runtime(sys.executable, None, ())
    prefix: tuple[str, ...] = ()
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "--net", "--", "true"], capture_output=True).returncode == 0:
        prefix = (unshare, "--net", "--")
    for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(python)
        if not os.path.exists(real) or not _reachable_by_others(real, stat.S_IXOTH):
            continue
        stdlib = _stdlib_of(python)
        if stdlib and _reachable_by_others(os.path.realpath(stdlib), stat.S_IROTH | stat.S_IXOTH):
            return _Runtime(python, NOBODY, prefix)
    logger.warning(
        "code sandbox: no Python interpreter is readable by uid %d, so sandboxed code runs as root "
        "(audit hook and limits still apply, RLIMIT_NPROC does not)",
        NOBODY,
    )
    return _Runtime(sys.executable, None, prefix)


def sandbox_layers() -> dict[str, object]:
    """Which protections are active on this host (for logs and docs)."""
    rt = _runtime()
    return {
        "network_namespace": bool(rt.prefix),
        "uid": rt.drop_uid if rt.drop_uid is not None else os.geteuid(),
        "python": rt.python,
        "audit_hook": True,
        "rlimits": True,
    }


def run_python(
    code: str, stdin: str = "", tests: str | None = None, limits: SandboxLimits | None = None
) -> SandboxResult:
    """Run ``code`` (fed ``stdin``) or, when ``tests`` is given, run ``code`` then each statement of ``tests``."""
    limits = limits or SandboxLimits()
    rt = _runtime()
    workdir = tempfile.mkdtemp(prefix="grpokit-sbx-")
    fds: list[int] = []
    try:
        Path(workdir, "solution.py").write_text(code, encoding="utf-8")
        if tests is None:
            Path(workdir, "input.txt").write_text(stdin, encoding="utf-8")
        else:
            Path(workdir, "tests.py").write_text(tests, encoding="utf-8")
        if rt.drop_uid is not None:
            os.chown(workdir, rt.drop_uid, rt.drop_uid)
        nonce = secrets.token_hex(16)
        nonce_r, nonce_w = os.pipe()
        report_r, report_w = os.pipe()
        fds += [nonce_r, nonce_w, report_r, report_w]
        cfg = {
            "workdir": workdir,
            "mode": "stdio" if tests is None else "asserts",
            "cpu_s": max(1, math.ceil(limits.timeout_s)),
            "mem_bytes": int(limits.memory_mb) << 20,
            "fsize_bytes": limits.max_file_bytes,
            "nofile": limits.max_open_files,
            "nproc": limits.max_processes,
            "nonce_fd": nonce_r,
            "report_fd": report_w,
            "drop_uid": rt.drop_uid,
        }
        cmd = [*rt.prefix, rt.python, "-I", "-S", "-B", "-X", "utf8", CHILD_SCRIPT, json.dumps(cfg)]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(nonce_r, report_w),
            start_new_session=True,
            cwd=workdir,
            env=env,
        )
        for fd in (nonce_r, report_w):
            os.close(fd)
            fds.remove(fd)
        try:
            os.write(nonce_w, nonce.encode())
        except OSError:  # the child died at start-up; _collect reports how
            pass
        os.close(nonce_w)
        fds.remove(nonce_w)
        result = _collect(proc, report_r, nonce, limits, start)
        result.elapsed_s = time.monotonic() - start
        return result
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child is not reaped yet, so its pid (= group id) is still ours
    except (ProcessLookupError, PermissionError):
        pass


def _collect(proc: subprocess.Popen, report_r: int, nonce: str, limits: SandboxLimits, start: float) -> SandboxResult:
    deadline = start + limits.timeout_s + STARTUP_ALLOWANCE_S
    bufs: dict[int, bytearray] = {fd: bytearray() for fd in (proc.stdout.fileno(), proc.stderr.fileno(), report_r)}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    timed_out = too_much = False
    try:
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=remaining):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                bufs[key.fd] += chunk
                if len(bufs[key.fd]) > limits.max_output_bytes:
                    too_much = True
            if too_much:
                break
    finally:
        sel.close()
        _kill_group(proc)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    stdout_b, stderr_b, report_b = (bytes(b) for b in bufs.values())  # insertion order: stdout, stderr, report
    return _classify(proc.returncode, stdout_b, stderr_b, report_b, nonce, timed_out, too_much, limits)


def _classify(
    rc: int | None,
    stdout_b: bytes,
    stderr_b: bytes,
    report_b: bytes,
    nonce: str,
    timed_out: bool,
    too_much: bool,
    limits: SandboxLimits,
) -> SandboxResult:
    cap = limits.max_output_bytes
    res = SandboxResult(
        status="ok",
        stdout=stdout_b[:cap].decode("utf-8", "replace"),
        stderr=stderr_b[:cap].decode("utf-8", "replace"),
        returncode=rc,
    )
    exceptions = []
    for line in report_b.decode("utf-8", "replace").splitlines():
        parts = line.split(" ")
        if len(parts) < 2 or parts[0] != nonce:
            continue  # not written by our preamble
        kind, args = parts[1], parts[2:]
        if kind == "blocked":
            res.blocked.append(" ".join(args))
        elif kind == "exception":
            exceptions.extend(args)
        elif kind == "assert" and len(args) >= 2 and args[1] == "pass" and args[0].isdigit():
            res.asserts_passed.add(int(args[0]))
    if too_much or rc == -signal.SIGXFSZ:
        res.status = "output_limit"
    elif timed_out or rc in (-signal.SIGXCPU, -signal.SIGKILL):
        res.status = "timeout"  # wall limit (we killed it) or CPU limit (the kernel did)
    elif res.blocked:
        res.status = "blocked"
    elif "MemoryError" in exceptions or b"MemoryError" in stderr_b or b"Cannot allocate memory" in stderr_b:
        res.status = "memory"
    elif rc is not None and rc < 0:
        res.status = "crash"
    elif exceptions or rc != 0:
        res.status = "error"
    return res
