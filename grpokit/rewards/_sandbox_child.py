"""Harness that runs inside the code sandbox: lock the process down, run the untrusted code, report on a pipe.

The parent ships this file's text on a pipe together with the job (the program, its limits, the BPF that refuses
``execve``, and in assert mode the steps to run), so nothing of the job touches a file system. It uses the
standard library only, because it may run under a system interpreter. Order:

1. the bootstrap (``sandbox.BOOT``) has read the job from its pipe into ``JOB``;
2. (privileged fallback only) drop to the slot uid; set the rlimits, then load the exec-refusing seccomp filter
   (``prctl``); if any of it fails, exit 121 without running the program;
3. install the audit hook (an extra layer for clearer errors; nothing relies on it);
4. run the program, then each step: ``exec`` runs set-up code, ``eval`` evaluates an expression and reports its
   value as tagged JSON. Only exact builtin types are encoded; anything else is reported as unserialisable.

Reports are JSON lines on the report pipe. The parent trusts none of them beyond "these are the values the
program's code produced": the expected values never enter the sandbox, and the parent does every comparison.
"""

from __future__ import annotations

import builtins
import json
import os
import resource
import sys
import traceback

HARNESS_FAILED = 121
_PROCESS_EVENTS = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen"}
_NAME_EVENTS = {"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"}
_BLOCKED_MODULES = {"ctypes", "_ctypes", "_posixsubprocess"}
_TAGGED = {tuple: "tuple", set: "set", frozenset: "frozenset"}


REPORT_FD = [4]


def _report(obj: dict) -> None:
    try:
        os.write(REPORT_FD[0], (json.dumps(obj) + "\n").encode())
    except (OSError, ValueError, TypeError):
        pass


def _set_limits(lim: dict) -> None:
    cpu = int(lim["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL a second later
    for res, key in ((resource.RLIMIT_AS, "mem_bytes"), (resource.RLIMIT_FSIZE, "fsize_bytes"),
                     (resource.RLIMIT_NOFILE, "nofile"), (resource.RLIMIT_NPROC, "nproc")):  # fmt: skip
        resource.setrlimit(res, (lim[key], lim[key]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _load_exec_filter(bpf: bytes) -> None:
    import ctypes

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # NO_NEW_PRIVS, SECCOMP
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]


def _hook(event: str, args: tuple) -> None:
    reason = None
    if event in _PROCESS_EVENTS or event in _NAME_EVENTS or event.startswith("ctypes."):
        reason = event
    elif event == "socket.__new__" and len(args) > 1 and args[1] not in (1, -1):  # AF_UNIX only
        reason = f"socket family {args[1]}"
    elif event == "import" and args and str(args[0]).split(".")[0] in _BLOCKED_MODULES:
        reason = f"import {args[0]}"
    if reason is not None:
        _report({"blocked": reason[:200]})
        raise PermissionError(f"sandbox: {reason} is not allowed")


def encode(value: object, depth: int = 0) -> object:
    """Tagged JSON for exact builtin types; TypeError for anything else (subclasses included)."""
    if depth > 200:
        raise TypeError("nested too deeply")
    t = type(value)
    if value is None or t in (bool, int, float, str):
        return value
    if t is list:
        return [encode(v, depth + 1) for v in value]
    if t in _TAGGED:
        return {"__t": _TAGGED[t], "v": [encode(v, depth + 1) for v in value]}
    if t is dict:
        return {"__t": "dict", "v": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    if t is bytes:
        return {"__t": "bytes", "v": value.hex()}
    if t is complex:
        return {"__t": "complex", "v": [value.real, value.imag]}
    raise TypeError(f"cannot serialise {t.__name__}")


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None or code == 0:
        return 0
    if not isinstance(code, int):
        print(code, file=sys.stderr)
        return 1
    return code & 0xFF or 1


def _run_program(source: str, ns: dict) -> int:
    try:
        exec(compile(source, "solution.py", "exec"), ns)
        return 0
    except SystemExit as exc:
        return _exit_code(exc)
    except BaseException as exc:
        _report({"exception": type(exc).__name__})
        try:
            traceback.print_exc()
        except BaseException:  # e.g. no memory left to format the traceback
            pass
        return 1


def _run_steps(steps: list, ns: dict) -> None:
    for k, (kind, src) in enumerate(steps):
        try:
            if kind == "exec":
                exec(compile(src, "tests.py", "exec"), ns)
                _report({"k": k, "ok": True})
            else:
                line = json.dumps({"k": k, "v": encode(eval(compile(src, "tests.py", "eval"), ns))})
                os.write(REPORT_FD[0], (line + "\n").encode())
        except BaseException as exc:  # SystemExit too: a test must not end the run
            _report({"k": k, "err": type(exc).__name__})
            if kind == "exec":
                return  # a failed set-up step fails everything after it


def _drop_uid(uid: int) -> None:
    """Privileged fallback only: become the slot uid, which clears every capability; refuse to go on otherwise."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getgroups():
        raise OSError("could not drop to the sandbox uid")


def main(job: dict) -> None:
    REPORT_FD[0] = int(job["report_fd"])
    try:
        if job.get("drop_uid") is not None:
            _drop_uid(int(job["drop_uid"]))
        _set_limits(job["limits"])
        if job.get("exec_filter"):
            _load_exec_filter(bytes.fromhex(job["exec_filter"]))
    except BaseException as exc:
        _report({"fatal": f"{type(exc).__name__}: {exc}"})
        os._exit(HARNESS_FAILED)
    sys.argv = ["solution.py"]
    sys.addaudithook(_hook)
    ns = {"__name__": "__main__", "__builtins__": builtins}
    status = _run_program(job["code"], ns)
    if status == 0 and job.get("steps") is not None:
        _run_steps(job["steps"], ns)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        status = status or 1
    _report({"exit": status})
    os._exit(status)


if __name__ == "__sandbox__":
    main(globals()["JOB"])
