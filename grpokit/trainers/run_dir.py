"""The run folder (--output_dir) as a place to write: created and probed before any model loads, held by one run
at a time (a lock file naming the pid), written atomically where a torn file would mislead a resume, and every
OS error on it turned into one line that names the path, the errno text and what to do.

Torch-free: the pipeline probes and locks the folder before anything heavy loads.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from grpokit.errors import GrpokitError

logger = logging.getLogger(__name__)
LOCK_FILE = ".grpokit.lock"
PROBE_FILE = ".grpokit-write-probe"
PROBE_BYTES = 4096  # a probe that writes nothing would pass on a full disk
LOW_SPACE_BYTES = 1 << 20  # below this much free space a failed write is taken for a full disk

_ADVICE = {
    errno.ENOSPC: "free space on that disk or choose another --output_dir, then resume with "
    "--resume_from_checkpoint latest",
    errno.EDQUOT: "raise the quota or free space, or choose another --output_dir",
    errno.EROFS: "the file system is read-only: choose a writable --output_dir",
    errno.EACCES: "fix the folder's permissions or choose another --output_dir",
    errno.EPERM: "fix the folder's permissions or choose another --output_dir",
    errno.ENOTDIR: "a file stands where a folder should be: move it away or choose another --output_dir",
    errno.EEXIST: "a file stands where a folder should be: move it away or choose another --output_dir",
    errno.EISDIR: "a folder stands where a file should be: move it away or choose another --output_dir",
    errno.ENAMETOOLONG: "choose a shorter --output_dir",
}


class OutputDirError(GrpokitError, OSError):
    """Writing to the run folder failed; the message names the path, the cause and the fix."""


def os_error_line(exc: BaseException, path: str | Path, doing: str) -> str:
    """``--output_dir: writing X: No space left on device [errno 28]; free space ...`` for any OS-level error,
    including the ones torch and safetensors wrap in their own exception types."""
    code = error_code(exc, path)
    where = getattr(exc, "filename", None) or path
    text = os.strerror(code) if code else str(exc).splitlines()[0][:200]
    advice = _ADVICE.get(code, "check the path and its disk, or choose another --output_dir")
    return f"--output_dir: {doing} {where}: {text}{f' [errno {code}]' if code else ''}; {advice}"


def error_code(exc: BaseException, path: str | Path) -> int | None:
    """The errno behind ``exc``: an OSError's own, one named in a wrapped message (safetensors writes
    ``Os { code: 28, ... }``, others ``[Errno 28]``), or ENOSPC when the write failed on a nearly full disk
    (torch.save says only "file write failed")."""
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    match = re.search(r"(?:code: |\[Errno |os error )(\d+)", str(exc))
    if match:
        return int(match.group(1))
    if "No space left" in str(exc) or _nearly_full(path):
        return errno.ENOSPC
    return None


def _nearly_full(path: str | Path) -> bool:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return os.statvfs(p).f_bavail * os.statvfs(p).f_frsize < LOW_SPACE_BYTES
    except OSError:
        return False


def is_write_failure(exc: BaseException, path: str | Path) -> bool:
    """An exception raised while writing under ``path`` that is the disk's or the folder's fault."""
    if isinstance(exc, OSError):
        return True
    if isinstance(exc, RuntimeError) or type(exc).__name__ == "SafetensorError":
        return error_code(exc, path) is not None
    return False


@contextlib.contextmanager
def output_errors(path: str | Path, doing: str) -> Iterator[None]:
    """Turn an OS error while writing under ``path`` into one OutputDirError line."""
    try:
        yield
    except OutputDirError:
        raise
    except Exception as exc:
        if not is_write_failure(exc, path):
            raise
        raise OutputDirError(os_error_line(exc, path, doing)) from exc


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, fsync, rename over it, fsync the folder."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def prepare_output_dir(output_dir: str | Path) -> Path:
    """Create ``output_dir`` and write (then remove) a probe file in it, so that a folder the run cannot write
    to, or a full disk, is found before the model loads."""
    out = Path(output_dir)
    with output_errors(out, "creating"):
        if out.exists() and not out.is_dir():
            raise OutputDirError(f"--output_dir {out}: is a file, not a folder; " + _ADVICE[errno.ENOTDIR])
        out.mkdir(parents=True, exist_ok=True)
    probe = out / f"{PROBE_FILE}-{os.getpid()}"
    with output_errors(probe, "writing a probe file"):
        try:
            with probe.open("wb") as f:
                f.write(b"\0" * PROBE_BYTES)
                f.flush()
                os.fsync(f.fileno())
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
    return out


class RunLock:
    """``output_dir/.grpokit.lock``: one run per folder. The file holds the owner's pid and host; a lock whose
    pid is gone (on this host) is stale and taken over, a live one refuses the second run. A lock file naming this
    very pid is a dead run's (a restarted container reuses pids) unless this process holds it now: a second run
    in one process (two TRL-API trainers, a callback starting another) is refused too."""

    _held_here: set[Path] = set()  # lock files this process holds

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self.held = False

    def acquire(self) -> None:
        if self.path.resolve() in RunLock._held_here:
            raise OutputDirError(
                _in_use_line(
                    self.path.parent,
                    {"pid": os.getpid(), "host": socket.gethostname()},
                    " (this process: another run in it)",
                )
            )
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": round(time.time()),
            "start": _start_ticks(os.getpid()),
        }
        for _ in range(3):  # a stale lock removed under us by another taker: try again
            with output_errors(self.path, "creating the lock file"):
                try:
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    owner = self._owner()
                    if owner is not None and _alive(owner):
                        raise OutputDirError(_in_use_line(self.path.parent, owner)) from None
                    if owner is not None:
                        logger.warning(
                            "--output_dir %s: taking over the lock of pid %s, which is gone",
                            self.path.parent,
                            owner.get("pid"),
                        )
                    with contextlib.suppress(FileNotFoundError):
                        self.path.unlink()
                    continue
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
            self.held = True
            RunLock._held_here.add(self.path.resolve())
            return
        raise OutputDirError(
            f"--output_dir {self.path.parent}: could not take {self.path} (another run keeps "
            "taking it); stop the other run or choose another --output_dir"
        )

    def _owner(self) -> dict | None:
        """The lock's owner, or None when the file is unreadable or torn (a lock whose writer died at once)."""
        try:
            owner = json.loads(self.path.read_text(encoding="utf-8")[:1000])
        except (OSError, ValueError):
            return None
        return owner if isinstance(owner, dict) and isinstance(owner.get("pid"), int) else None

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        RunLock._held_here.discard(self.path.resolve())
        owner = self._owner()
        if owner is not None and owner.get("pid") == os.getpid():
            with contextlib.suppress(OSError):
                self.path.unlink()


def _alive(owner: dict) -> bool:
    """The owner still runs: on this host, its pid exists (our own pid counts as re-entry, not as another
    run); on another host we cannot tell, so it counts as alive."""
    if owner.get("host") != socket.gethostname():
        return True
    pid = owner["pid"]
    if pid == os.getpid():
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if _proc_stat(pid)[:1] == ["Z"]:  # exited, not reaped yet
        return False
    started = owner.get("start")  # the pid taken by another process since (a restarted container)
    return started is None or _start_ticks(pid) in (None, started)


def _proc_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (state first); [] where there is no /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return []


def _start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    fields = _proc_stat(pid)
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def _in_use_line(output_dir: Path, owner: dict, where: str = "") -> str:
    host = owner.get("host")
    where = where if host == socket.gethostname() else f" on host {host}"
    return (
        f"--output_dir {output_dir} is in use by pid {owner['pid']}{where}: wait for that run to end, stop it, "
        f"or choose another --output_dir (if it is gone, delete {output_dir / LOCK_FILE})"
    )
