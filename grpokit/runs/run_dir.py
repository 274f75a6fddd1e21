"""The run folder (--output_dir) as a place to write: created and probed before any model loads, held by one run
at a time (a kernel lock on a file that names the pid), written atomically where a torn file would mislead a
resume, and every OS error on it turned into one line that names the path, the errno text and what to do.

Torch-free: the pipeline probes and locks the folder before anything heavy loads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import socket
import stat
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
    """``output_dir/.grpokit.lock``: one run per folder. The lock is the kernel's (``fcntl.flock`` on the file,
    held through an open descriptor for the life of the process), so it is taken atomically and dies with its
    process (exit, kill -9): there is no stale lock to take over and no race in taking one. The file also holds
    the owner's pid and host, only to name the owner when a second run is refused. The file is never removed:
    a removal between another process's open and its flock would hand out two locks on two files."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        with output_errors(self.path, "creating the lock file"):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OutputDirError(f"--output_dir: {self.path} is not a regular file; move it away")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise OutputDirError(_in_use_line(self.path.parent, _owner(fd))) from None
                me = {"pid": os.getpid(), "host": socket.gethostname(), "since": round(time.time())}
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(me).encode(), 0)
            except BaseException:
                os.close(fd)
                raise
        self._fd = fd

    def release(self) -> None:
        """Unlock and close (the kernel does the same when the process dies)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)


def _owner(fd: int) -> dict:
    """What the lock holder wrote (pid, host); {} while it has not written yet or the text is not ours."""
    try:
        owner = json.loads(os.pread(fd, 1000, 0).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _in_use_line(output_dir: Path, owner: dict) -> str:
    pid, host = owner.get("pid"), owner.get("host")
    who = f"pid {pid}" if isinstance(pid, int) else "another process"
    where = f" on host {host}" if isinstance(host, str) and host != socket.gethostname() else ""
    return (
        f"--output_dir {output_dir} is in use by {who}{where}: wait for that run to end, stop it, "
        "or choose another --output_dir"
    )
