"""What the code sandbox needs from the host, checked once, and the bubblewrap command line built from it.

``resolve(mode)`` returns a ``Runtime`` or raises ``IsolationUnavailable`` with one line naming what is missing and
how to get it. Modes:

- ``bwrap`` (default): every run in fresh user, PID, mount, network, IPC, UTS and cgroup namespaces made by
  bubblewrap, with a read-only root (only ``/usr``, a minimal ``/etc`` (``ETC_FILES``), the interpreter's prefix
  and the ``/lib``-style links), a private tmpfs at ``/tmp`` (the work dir; the harness mounts it with a size and
  an inode bound while it still holds ``CAP_SYS_ADMIN`` of the sandbox's user namespace, then clears every
  capability), a fresh ``/proc`` that shows the sandbox only, a minimal read-only ``/dev``, no nested user
  namespaces (the seccomp filter refuses them), and the seccomp filter of ``seccomp_filter``. The program is uid 0
  of its user namespace, without capabilities; when the trainer runs as root, bubblewrap itself is started as a
  per-slot uid, which that uid 0 maps to, so the sandbox owns nothing on the host. If that uid may not create user
  namespaces (they are disabled for unprivileged users), root runs bubblewrap without a user namespace and the
  harness mounts ``/tmp``, then drops to the slot uid (``setresuid``, which clears every capability) before it
  reads the program.
- ``none``: no isolation at all (rlimits and the audit hook only). Unsafe; logged as a warning at every start.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from grpokit.config.reward_args import ISOLATION_MODES
from grpokit.rewards import seccomp_filter

logger = logging.getLogger(__name__)

SETUP_HINT = "scripts/setup_system.sh installs it"
_PROBE = "import os, sys; print(os.path.realpath(sys.base_prefix)); print(os.path.dirname(os.__file__))"
_LIB_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# the only files of the host's /etc a sandbox sees: what the dynamic loader and Python's time and locale need
ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/nsswitch.conf")
SLOT_UID_BASE = 1_600_000_000  # + (pid % 50000) * 256 + slot when the trainer runs as root


class IsolationUnavailable(OSError):
    """The requested isolation cannot be had on this host (the message says what is missing)."""


@dataclass(frozen=True)
class Runtime:
    mode: str
    python: str  # the interpreter, at the same path inside the sandbox
    bwrap: str | None = None
    mounts: tuple[str, ...] = ()
    as_root: bool = False  # root parent: each concurrent slot runs as its own uid
    privileged: bool = False  # root runs bwrap itself (no unprivileged user namespaces); the harness drops the uid
    setpriv: str | None = None  # util-linux's setpriv: drops root to the slot uid without forking a big trainer

    def slot_uid(self, slot: int) -> int | None:
        if not self.as_root:
            return None
        return self.slot_uids().start + slot % 256

    def slot_uids(self) -> range:
        """The uids this process's sandboxes run as (when root); no other process on the host uses them."""
        start = SLOT_UID_BASE + (os.getpid() % 50_000) * 256
        return range(start, start + 256)


def _reachable_by_others(path: str, need: int) -> bool:
    p = Path(path)
    try:
        return bool(p.stat().st_mode & need) and all(q.stat().st_mode & stat.S_IXOTH for q in p.parents)
    except OSError:
        return False


def _probe(python: str) -> tuple[str, str] | None:
    """(prefix, stdlib dir) of an interpreter, or None when it does not run."""
    try:
        out = subprocess.run([python, "-I", "-S", "-c", _PROBE], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    return (lines[0], lines[1]) if out.returncode == 0 and len(lines) == 2 else None


def _interpreter(as_root: bool) -> tuple[str, str]:
    """An interpreter the sandbox user can run, and the prefix to mount for it."""
    candidates = [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]
    for python in candidates:
        real = os.path.realpath(python)
        if not os.path.exists(real) or (as_root and not _reachable_by_others(real, stat.S_IXOTH)):
            continue
        found = _probe(real)
        if found and (not as_root or _reachable_by_others(found[1], stat.S_IROTH | stat.S_IXOTH)):
            return real, found[0]
    raise IsolationUnavailable(
        "code_exec: no Python interpreter that an unprivileged sandbox user can read (the project's is under a "
        "private directory); install the system one with `apt-get install python3` (" + SETUP_HINT + ")"
    )


def _mounts(prefix: str) -> tuple[str, ...]:
    args = ["--ro-bind", "/usr", "/usr", "--dir", "/etc"]
    for path in ETC_FILES:
        if os.path.isfile(path):
            args += ["--ro-bind", os.path.realpath(path), path]
    for link in _LIB_LINKS:
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            args += ["--ro-bind", link, link]
    if not (prefix == "/usr" or prefix.startswith("/usr/")):
        args += ["--ro-bind", prefix, prefix]
    return tuple(args)


def _need_bwrap() -> str:
    bwrap = shutil.which("bwrap") or ("/usr/bin/bwrap" if os.path.exists("/usr/bin/bwrap") else None)
    if bwrap is None:
        raise IsolationUnavailable(
            "code_exec: bubblewrap is missing; install it with `apt-get install bubblewrap` (" + SETUP_HINT + "), "
            "or pass --code_exec_isolation none to run untrusted code without isolation (unsafe)"
        )
    return bwrap


@functools.lru_cache(maxsize=4)
def resolve(mode: str = "bwrap") -> Runtime:
    if os.name != "posix" or not sys.platform.startswith("linux"):
        raise IsolationUnavailable("code_exec: the sandbox needs Linux (namespaces, seccomp, rlimits)")
    if mode not in ISOLATION_MODES:
        raise IsolationUnavailable(f"--code_exec_isolation {mode!r}: choose one of {', '.join(ISOLATION_MODES)}")
    as_root = os.geteuid() == 0
    if mode == "none":
        python = os.path.realpath(sys.executable)
        if as_root and not _reachable_by_others(python, stat.S_IXOTH):
            python, _ = _interpreter(as_root)
        return Runtime("none", python, as_root=as_root, setpriv=shutil.which("setpriv"))
    bwrap = _need_bwrap()
    try:
        seccomp_filter.main_filter()
        seccomp_filter.late_filter()
    except seccomp_filter.SeccompUnavailable as exc:
        raise IsolationUnavailable(f"code_exec: {exc} ({SETUP_HINT})") from exc
    python, prefix = _interpreter(as_root)
    return Runtime("bwrap", python, bwrap, _mounts(prefix), as_root, setpriv=shutil.which("setpriv"))


def drop_to(rt: Runtime, uid: int | None) -> tuple[list[str], dict]:
    """(command prefix, Popen keywords) that start the child as ``uid``. setpriv when there is one: Popen's own
    ``user=`` forces a full fork of the trainer, tens of milliseconds once it holds a model."""
    if uid is None or rt.privileged:
        return [], {}
    if rt.setpriv:
        return [rt.setpriv, "--reuid", str(uid), "--regid", str(uid), "--clear-groups"], {}
    return [], {"user": uid, "group": uid, "extra_groups": []}


def hint_for(error: str) -> str:
    """What to do about a bubblewrap error line (empty when there is nothing specific to say)."""
    if "namespace" in error or "Operation not permitted" in error or "Permission denied" in error:
        return (
            " (bubblewrap needs unprivileged user namespaces: `sysctl -w kernel.unprivileged_userns_clone=1` "
            "and user.max_user_namespaces > 0; on Ubuntu 24.04+ also kernel.apparmor_restrict_unprivileged_"
            "userns=0; in a container, a seccomp profile that allows unshare)"
        )
    return ""


def bwrap_args(rt: Runtime, uid: int | None, disk_bytes: int, seccomp_fd: int, status_fd: int) -> list[str]:
    """The bubblewrap part of the command (everything before the interpreter)."""
    # the harness keeps CAP_SYS_ADMIN (of the sandbox's own user namespace, or of its private mount namespace in
    # the privileged fallback) just long enough to mount /tmp with an inode bound, then clears every capability
    if rt.privileged:  # no user namespace: also what the harness needs to drop to the slot uid
        user = ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SYS_ADMIN"]
    else:  # uid 0 inside, mapped to the slot uid (bubblewrap's own --uid nests a second user namespace, which
        # would own no mount namespace); nested user namespaces are refused by the seccomp filter
        user = ["--unshare-user", "--uid", "0", "--gid", "0", "--cap-drop", "ALL", "--cap-add", "CAP_SYS_ADMIN"]
    return [
        rt.bwrap, *user, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
        "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--as-pid-1",
        "--hostname", "sandbox", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
        "--setenv", "LANG", "C.UTF-8", "--setenv", "HOME", "/tmp", "--setenv", "TMPDIR", "/tmp",
        *rt.mounts, "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
        "--perms", "1777", "--size", str(disk_bytes), "--tmpfs", "/tmp", "--chdir", "/tmp", "--remount-ro", "/",
        "--seccomp", str(seccomp_fd), "--json-status-fd", str(status_fd), "--",
    ]  # fmt: skip


def cgroup_delegation() -> str:
    """Whether this process could give each sandbox a cgroup v2 ``memory.max``/``pids.max``, in one line. The
    sandbox does not create cgroups: on the machines it runs on they belong to the supervisor, and memory is
    bounded by rlimits, the seccomp refusals and the tmpfs bounds instead. What would be needed: a cgroup v2
    hierarchy at /sys/fs/cgroup, this process's cgroup writable by it, with ``memory`` and ``pids`` enabled in its
    ``cgroup.subtree_control`` (systemd's ``Delegate=yes``) and the trainer itself in a leaf beside the sandboxes'."""
    root = Path("/sys/fs/cgroup")
    if not (root / "cgroup.controllers").exists():
        return "no: /sys/fs/cgroup is not a cgroup v2 hierarchy (v1 or hybrid)"
    try:
        own = next(line.split("::", 1)[1].strip() for line in open("/proc/self/cgroup") if line.startswith("0::"))
    except (OSError, StopIteration):
        return "no: this process has no cgroup v2 path"
    mine = root / own.lstrip("/")
    try:
        enabled = set((mine / "cgroup.subtree_control").read_text().split())
    except OSError as exc:
        return f"no: {mine}/cgroup.subtree_control is not readable ({exc.strerror})"
    if not os.access(mine, os.W_OK):
        return f"no: {mine} is not writable by this process (not delegated)"
    if not {"memory", "pids"} <= enabled:
        return f"no: memory and pids are not enabled for the children of {mine}"
    return f"available at {mine} (not used: see docs/rewards.md)"


def describe(rt: Runtime) -> dict[str, object]:
    """Which protections are active (for logs and docs)."""
    iso = rt.mode == "bwrap"
    return {
        "isolation": rt.mode,
        "namespaces": ["pid", "mount", "net", "ipc", "uts", "cgroup"] + ["user"] * (not rt.privileged) if iso else [],
        "root_fallback": rt.privileged,
        "network_namespace": iso,
        "seccomp": iso,
        "private_tmpfs": iso,
        "per_slot_uid": rt.as_root,
        "python": rt.python,
        "audit_hook": True,
        "rlimits": True,
        "tmpfs_inode_bound": iso,
        "cgroup_v2_delegation": cgroup_delegation(),
    }


def _proc_status(pid: str) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            return dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}


def live_sandbox_processes(rt: Runtime | None = None) -> list[int]:
    """Pids on the host that belong to this process's sandboxes: those running as its slot uids (root), else its
    descendants. Other processes' sandboxes are never counted, so concurrent trainers or test runs do not mix."""
    rt = rt or resolve("bwrap")
    uids = rt.slot_uids() if rt.as_root else None
    parents: dict[int, int] = {}
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        st = _proc_status(pid)
        if not st:
            continue
        if uids is not None and int(st.get("Uid", "-1").split()[0]) in uids:
            found.append(int(pid))
        parents[int(pid)] = int(st.get("PPid", "0").strip() or 0)
    if uids is None:
        me = os.getpid()
        for pid in parents:
            p, seen = parents.get(pid), 0
            while p and p != me and seen < 64:
                p, seen = parents.get(p), seen + 1
            if p == me:
                found.append(pid)
    return sorted(found)
