"""Child side of the code sandbox: set limits, drop privileges, install an audit hook, run the untrusted code.

Started by ``grpokit.rewards.sandbox`` as ``python -I -S -B -X utf8 _sandbox_child.py CONFIG_JSON``; it uses the
standard library only. It reports to the parent on a private pipe, each line prefixed with a nonce that it read
from another pipe (and closed) before the untrusted code starts, so that the code cannot forge a report by
printing or by writing to the report pipe. Order matters: everything that needs privileges or reads our own files
happens before the audit hook goes in, and the hook goes in right before the untrusted code runs.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import resource
import sys
import traceback
from typing import Any, Callable

Report = Callable[..., None]

_PROCESS_EVENTS = {
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
    "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit", "os.setuid",
    "os.setgid", "os.setreuid", "os.setresuid", "os.chroot", "os.unshare", "os.setns",
}  # fmt: skip
_BLOCKED_PREFIXES = ("socket.", "ctypes.")
_BLOCKED_MODULES = {"ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters", "_testcapi", "_testinternalcapi"}
# event -> positions of its path arguments that must lie inside the working directory
_WRITE_PATH_EVENTS = {
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
    "os.truncate": (0,), "os.utime": (0,), "os.chflags": (0,), "os.lchflags": (0,), "os.setxattr": (0,),
    "os.removexattr": (0,), "os.rename": (0, 1), "os.link": (0, 1), "os.symlink": (1,), "os.mkfifo": (0,),
    "os.mknod": (0,), "shutil.rmtree": (0,), "sqlite3.connect": (0,),
}  # fmt: skip
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def main() -> None:
    cfg = json.loads(sys.argv[1])
    nonce = os.read(cfg["nonce_fd"], 128).decode().strip()
    os.close(cfg["nonce_fd"])
    report_fd = cfg["report_fd"]

    def report(*parts: str) -> None:
        try:
            os.write(report_fd, (" ".join((nonce, *parts)) + "\n").encode())
        except OSError:
            pass

    root = os.path.realpath(cfg["workdir"])
    with open(os.path.join(root, "solution.py"), encoding="utf-8") as f:
        source = f.read()
    tests_source = None
    if cfg["mode"] == "asserts":
        with open(os.path.join(root, "tests.py"), encoding="utf-8") as f:
            tests_source = f.read()
    else:
        fd = os.open(os.path.join(root, "input.txt"), os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)

    _set_limits(cfg)
    if cfg["drop_uid"] is not None and os.geteuid() == 0:
        os.setgroups([])
        os.setgid(cfg["drop_uid"])
        os.setuid(cfg["drop_uid"])
    report("uid", str(os.geteuid()))
    os.chdir(root)
    os.environ.clear()
    os.environ.update({"HOME": root, "TMPDIR": root, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    sys.argv = ["solution.py"]

    sys.addaudithook(_make_hook(root, report))
    status = _run(source, tests_source, report)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        status = status or 1
    report("exit", str(status))
    os._exit(status)


def _set_limits(cfg: dict) -> None:
    cpu = int(cfg["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL one second later
    resource.setrlimit(resource.RLIMIT_AS, (cfg["mem_bytes"], cfg["mem_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["fsize_bytes"], cfg["fsize_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["nofile"], cfg["nofile"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _make_hook(root: str, report: Report) -> Callable[[str, tuple], None]:
    busy = [False]

    def inside(path: Any) -> bool:
        if isinstance(path, int) or path is None:
            return True  # an already-open descriptor; opening it was checked
        p = os.path.realpath(os.fsdecode(path))
        return p == root or p.startswith(root + os.sep)

    def why_blocked(event: str, args: tuple) -> str | None:
        if event in _PROCESS_EVENTS or event.startswith(_BLOCKED_PREFIXES):
            return event
        if event == "import" and args and str(args[0]).split(".")[0] in _BLOCKED_MODULES:
            return f"import:{args[0]}"
        if event == "open":
            path, mode, flags = args[0], args[1], args[2] if len(args) > 2 else 0
            writes = (isinstance(mode, str) and any(ch in mode for ch in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
            if writes and not inside(path):
                return f"open-write:{os.fsdecode(path)}"
        positions = _WRITE_PATH_EVENTS.get(event)
        if positions:
            for i in positions:
                if i < len(args) and isinstance(args[i], (str, bytes, os.PathLike)) and not inside(args[i]):
                    return f"{event}:{os.fsdecode(args[i])}"
        return None

    def hook(event: str, args: tuple) -> None:
        if busy[0]:
            return
        busy[0] = True
        try:
            reason = why_blocked(event, args)
        finally:
            busy[0] = False
        if reason is not None:
            report("blocked", reason.replace("\n", " ")[:200])
            raise PermissionError(f"sandbox: {reason} is not allowed")

    return hook


def _run(source: str, tests_source: str | None, report: Report) -> int:
    ns = {"__name__": "__main__", "__builtins__": builtins}
    status = _exec(source, "solution.py", ns, report)
    if tests_source is None or status != 0:
        return status
    stmts = ast.parse(tests_source).body
    n_asserts = sum(isinstance(s, ast.Assert) for s in stmts)
    k = 0
    for stmt in stmts:
        code = compile(ast.Module(body=[stmt], type_ignores=[]), "tests.py", "exec")
        try:
            exec(code, ns)
            ok, err = True, ""
        except BaseException as exc:  # SystemExit too: a test must not end the run
            ok, err = False, type(exc).__name__
        if isinstance(stmt, ast.Assert):
            report("assert", str(k), "pass" if ok else "fail", err)
            k += 1
        elif not ok:
            report("setup_fail", err)
            return 0
    if n_asserts == 0:
        report("assert", "0", "pass")
    return 0


def _exec(source: str, filename: str, ns: dict, report: Report) -> int:
    try:
        exec(compile(source, filename, "exec"), ns)
        return 0
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            return 0
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            return 1
        return code & 0xFF or 1
    except BaseException as exc:
        report("exception", type(exc).__name__)
        try:
            traceback.print_exc()
        except BaseException:  # e.g. no memory left to format the traceback
            pass
        return 1


if __name__ == "__main__":
    main()
