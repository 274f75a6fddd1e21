"""What one sandboxed run produced: its limits, its result, and why it failed, decided from what the parent saw.

Statuses (``FAILURE_KINDS``) rest on the parent's own evidence only: ``timeout`` when its deadline passed or the
kernel reports the CPU limit used up; ``output_limit`` when it counted too many bytes; ``memory`` for a failed run
whose peak resident memory reached half of its limit (VmHWM, read by the parent from /proc while the child is
alive, or the kernel's count at ``wait4`` where that is not mixed up with the trainer's own memory); ``crash`` when
the child died of a signal (or claims so with an exit code above 128: the two look the same through bubblewrap);
``error`` for any other failure. A program cannot pick its status with an exit code or a report.

Report lines are parsed defensively (``parse_report``): bounded size, bounded integers (larger ones travel as
hex, tagged), and a line that does not parse is dropped, never raised.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from grpokit.rewards._sandbox_child import HARNESS_FAILED

logger = logging.getLogger("grpokit.rewards.sandbox")

FAILURE_KINDS = ("timeout", "memory", "output_limit", "crash", "error")
MAX_INT_DIGITS = 20  # a plain JSON int longer than this is a forgery (the harness sends large ones as hex)
LOG_CUT = 200  # characters of a sample's text that reach the trainer's log


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0
    memory_mb: int = 512
    max_output_bytes: int = 1 << 20  # per stream (stdout, stderr) and per report line
    max_report_bytes: int = 16 << 20  # all the answers of one run
    max_file_bytes: int = 16 << 20
    max_disk_bytes: int = 64 << 20  # the private /tmp of one run
    max_inodes: int = 4096  # files, directories and links in it (each is kernel memory the size does not count)
    max_open_files: int = 64
    max_processes: int = 64  # threads, per slot uid


@dataclass
class SandboxResult:
    status: str  # "ok" or one of FAILURE_KINDS
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None
    cpu_s: float = 0.0  # CPU time of the child (the kernel's count)
    peak_rss_bytes: int = 0
    elapsed_s: float = 0.0


def _small_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:
        raise ValueError("integer too long")
    return int(text)


def parse_report(line: bytes) -> dict | None:
    """One report line as a dict, or None (not JSON, too deep, an over-long integer, not an object)."""
    try:
        doc = json.loads(line, parse_int=_small_int)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return None
    return doc if isinstance(doc, dict) else None


def log_safe(text: object) -> str:
    """A sample's text for the log: control characters escaped (no forged lines, no terminal escapes), cut."""
    s = str(text)[: LOG_CUT * 4]
    s = s.encode("unicode_escape", "backslashreplace").decode("ascii", "replace")
    return s if len(s) <= LOG_CUT else s[:LOG_CUT] + "…"


def classify(rc, stdout_b, stderr_b, notes: list[dict], timed_out: bool, too_much: bool, cpu_s: float,
             peak_bytes: int, limits: SandboxLimits) -> SandboxResult:  # fmt: skip
    cap = limits.max_output_bytes
    res = SandboxResult("ok", stdout_b[:cap].decode("utf-8", "replace"), stderr_b[:cap].decode("utf-8", "replace"),
                        rc, cpu_s, peak_bytes)  # fmt: skip
    cpu_limit = max(1, -(-limits.timeout_s // 1))
    if too_much:
        res.status = "output_limit"
    elif timed_out or cpu_s >= cpu_limit - 0.05:
        res.status = "timeout"
    elif rc != 0 and peak_bytes >= (int(limits.memory_mb) << 20) // 2:
        res.status = "memory"
    elif rc is not None and (rc < 0 or rc > 128):
        res.status = "crash"
    elif rc != 0 or any("blocked" in n for n in notes):
        res.status = "error"  # a refusal of the audit hook that the code caught still fails (it can only lose)
    if rc == HARNESS_FAILED:
        fatal = [n["fatal"] for n in notes if "fatal" in n]
        if fatal:  # the program may write this too: escaped and cut, it is only a hint
            logger.warning(
                "code sandbox: exit %d; the harness reports it could not lock the process down: %s",
                rc,
                log_safe(fatal[0]),
            )
    return res
