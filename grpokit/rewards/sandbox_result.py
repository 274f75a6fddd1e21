"""What one sandboxed run produced: its limits, its result, and how exit codes and reports map to a status."""

from __future__ import annotations

import json
import logging
import signal
from dataclasses import dataclass, field

from grpokit.rewards._sandbox_child import HARNESS_FAILED

logger = logging.getLogger("grpokit.rewards.sandbox")

FAILURE_KINDS = ("timeout", "memory", "blocked", "output_limit", "crash", "error", "killed")
_SIG = {s: 128 + s for s in (signal.SIGKILL, signal.SIGXCPU, signal.SIGXFSZ, signal.SIGSYS)}


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0
    memory_mb: int = 512
    max_output_bytes: int = 1 << 20  # per stream (stdout, stderr, reports)
    max_file_bytes: int = 16 << 20
    max_disk_bytes: int = 64 << 20  # the private /tmp of one run
    max_open_files: int = 64
    max_processes: int = 64  # threads, per slot uid


@dataclass
class SandboxResult:
    status: str  # "ok" or one of FAILURE_KINDS
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None
    asserts_passed: set[int] = field(default_factory=set)
    blocked: list[str] = field(default_factory=list)
    steps: dict[int, dict] = field(default_factory=dict)  # step index -> its first report
    elapsed_s: float = 0.0


def _reports(report_b: bytes) -> list[dict]:
    out = []
    for line in report_b.decode("utf-8", "replace").splitlines():
        try:
            doc = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out


def classify(rc, stdout_b, stderr_b, report_b, timed_out, too_much, limits: SandboxLimits) -> SandboxResult:
    cap = limits.max_output_bytes
    res = SandboxResult("ok", stdout_b[:cap].decode("utf-8", "replace"), stderr_b[:cap].decode("utf-8", "replace"), rc)
    exceptions, fatal = [], None
    for doc in _reports(report_b):
        if isinstance(doc.get("k"), int) and doc["k"] not in res.steps:
            res.steps[doc["k"]] = doc
        elif "blocked" in doc:
            res.blocked.append(str(doc["blocked"]))
        elif "exception" in doc:
            exceptions.append(str(doc["exception"]))
        elif "fatal" in doc:
            fatal = str(doc["fatal"])
    died_of = {-s: s for s in _SIG} | {v: s for s, v in _SIG.items()}
    sig = died_of.get(rc)
    if too_much or sig == signal.SIGXFSZ:
        res.status = "output_limit"
    elif timed_out or sig == signal.SIGXCPU:
        res.status = "timeout"  # wall limit (we killed it) or CPU limit (the kernel did)
    elif sig == signal.SIGSYS or res.blocked:
        res.status = "blocked"  # seccomp killed it, or the audit hook refused something
    elif sig == signal.SIGKILL:
        res.status = "killed"  # not by us: the OOM killer or another process
    elif "MemoryError" in exceptions or b"MemoryError" in stderr_b or b"Cannot allocate memory" in stderr_b:
        res.status = "memory"
    elif rc == HARNESS_FAILED and fatal:
        logger.warning("code sandbox: the harness could not lock the process down: %s", fatal)
        res.status = "error"
    elif rc is not None and (rc < 0 or rc > 128):
        res.status = "crash"
    elif exceptions or rc != 0:
        res.status = "error"
    return res
