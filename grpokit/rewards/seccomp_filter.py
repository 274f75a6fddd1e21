"""Seccomp filters for the code sandbox, compiled to BPF by libseccomp (through ctypes; no Python binding needed).

Two programs, both deny lists on top of the user/PID/mount/network namespaces that bubblewrap sets up:

- ``main_filter()`` goes to ``bwrap --seccomp FD`` and holds from the interpreter's first instruction: no process
  creation other than threads, no sockets (AF_UNIX refused with EPERM, any other family kills), no
  ptrace/namespace/mount/kernel-module/BPF/io_uring calls.
- ``late_filter()`` refuses ``execve``/``execveat`` and the mount calls. It cannot go to bwrap (bwrap must still
  exec the interpreter, and the harness mounts the private ``/tmp`` with an inode bound, which bwrap cannot), so
  the sandbox harness loads it with ``prctl`` before the untrusted code is even read.

Refused calls kill the whole process (SIGSYS); ``clone3`` fails with ENOSYS instead, so that glibc falls back to
``clone``, whose flags the filter can inspect. Calls from another ABI (x32, i386) hit libseccomp's
bad-architecture action, which kills too. Calls that would hold memory outside the address-space limit (SysV
shared memory, message queues and semaphores, POSIX message queues, memfds, unix sockets, whose queued data the
kernel holds outside every rlimit), watch or lock files that other
processes share (inotify, fanotify, ``flock``, ``fcntl`` locks and leases), fail with EPERM instead: refused,
without killing a program that merely tries.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import tempfile

KILL_PROCESS = 0x80000000
ALLOW = 0x7FFF0000
_CMP_NE = 1
_CMP_MASKED_EQ = 7
_CLONE_THREAD = 0x00010000
_AF_UNIX = 1

# calls a sandboxed program never needs; each one kills it
_DENIED = (
    "fork", "vfork", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "unshare", "setns", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl", "add_key", "request_key",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "syslog", "open_by_handle_at", "name_to_handle_at", "iopl", "ioperm",
    "sethostname", "setdomainname", "settimeofday", "clock_settime", "adjtimex", "clock_adjtime",
)  # fmt: skip
_LATE = ("execve", "execveat", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
         "fsmount", "fsconfig", "fspick", "mount_setattr")  # fmt: skip
# refused with EPERM: kernel memory the rlimits do not count, watches and locks on shared files, inode floods
_REFUSED = (
    "shmget", "shmat", "msgget", "msgsnd", "semget", "semop", "mq_open", "memfd_create", "memfd_secret",
    "inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init", "fanotify_mark", "flock",
)  # fmt: skip
# F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW, F_SETLEASE, F_SETPIPE_SZ (a pipe of 1 MiB is kernel memory too)
_FCNTL_REFUSED = (6, 7, 37, 38, 1024, 1031)
_CMP_EQ = 4


class SeccompUnavailable(OSError):
    """libseccomp could not be loaded or refused a rule."""


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise SeccompUnavailable(f"libseccomp not found ({exc}); install it with `apt-get install libseccomp2`")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp)]  # fmt: skip
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _Filter:
    def __init__(self) -> None:
        self.lib = _lib()
        self.ctx = self.lib.seccomp_init(ALLOW)
        if not self.ctx:
            raise SeccompUnavailable("seccomp_init failed")

    def rule(self, action: int, name: str, *cmps: tuple[int, int, int, int]) -> None:
        nr = self.lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:  # not a call on this architecture (e.g. fork on aarch64): nothing to refuse
            return
        arr = (_ArgCmp * max(1, len(cmps)))(*[_ArgCmp(*c) for c in cmps])
        rc = self.lib.seccomp_rule_add_array(self.ctx, action, nr, len(cmps), arr)
        if rc < 0:
            raise SeccompUnavailable(f"libseccomp refused the rule for {name}: {os.strerror(-rc)}")

    def export(self) -> bytes:
        with tempfile.TemporaryFile() as f:
            rc = self.lib.seccomp_export_bpf(self.ctx, f.fileno())
            if rc < 0:
                raise SeccompUnavailable(f"seccomp_export_bpf failed: {os.strerror(-rc)}")
            f.seek(0)
            return f.read()

    def __del__(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.seccomp_release(self.ctx)


@functools.lru_cache(maxsize=1)
def main_filter() -> bytes:
    """BPF for ``bwrap --seccomp``: everything but exec (see the module docstring)."""
    f = _Filter()
    for name in _DENIED:
        f.rule(KILL_PROCESS, name)
    f.rule(KILL_PROCESS, "clone", (0, _CMP_MASKED_EQ, _CLONE_THREAD, 0))  # a new process, not a thread
    f.rule(_errno_action(errno.ENOSYS), "clone3")
    for call in ("socket", "socketpair"):  # other families kill; AF_UNIX is refused: its buffers are kernel memory
        f.rule(KILL_PROCESS, call, (0, _CMP_NE, _AF_UNIX, 0))
        f.rule(_errno_action(errno.EPERM), call, (0, _CMP_EQ, _AF_UNIX, 0))
    for name in _REFUSED:
        f.rule(_errno_action(errno.EPERM), name)
    for cmd in _FCNTL_REFUSED:
        f.rule(_errno_action(errno.EPERM), "fcntl", (1, _CMP_EQ, cmd, 0))
    return f.export()


@functools.lru_cache(maxsize=1)
def late_filter() -> bytes:
    """BPF that refuses starting a new program and mounting; loaded by the harness inside the sandbox."""
    f = _Filter()
    for name in _LATE:
        f.rule(KILL_PROCESS, name)
    return f.export()
