"""Harness that runs inside the code sandbox: lock the process down, run the untrusted code, report on a pipe.

The parent ships this file's text on a pipe together with the job (the program, its limits, the BPF that refuses
``execve`` and mounts; then, in call mode, the parent's calls), so nothing of the job touches a file system. It uses the
standard library only, because it may run under a system interpreter. Order:

1. the bootstrap (``sandbox.BOOT``) has read the job (the first line of its pipe) into ``JOB``;
2. mount the private ``/tmp`` (size and inode bounds); (privileged fallback only) drop to the slot uid; clear
   every capability; load the late seccomp filter (``prctl``: exec and the mount calls); set the rlimits; if
   any of it fails, exit 121 without running the program;
3. install the audit hook (an extra layer for clearer errors; nothing relies on it);
4. run the program; in call mode (``JOB["serve"]``) then answer the parent's requests, one JSON line each on the
   job pipe: ``{"q": n, "src": expression, "a": [tagged arguments]}``. The expression reads its arguments as
   ``__A[i]`` and earlier results as ``__R[j]``; the answer is ``{"q": n, "v": tagged value}`` for exact builtin
   types, ``{"q": n, "ref": n}`` for anything else (kept here as ``__R[n]``, so the parent can call its methods),
   or ``{"q": n, "err": name, "mro": [names]}``. EOF on the job pipe ends the run.

Reports are JSON lines on the report pipe. The parent trusts none of them beyond "these are the values the
program's code produced": the tests never enter the sandbox (only the calls the parent makes, with their
arguments), and the parent decides every verdict.
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
_SMALL_INT = 1 << 62  # larger ints travel as hex text: no decimal digit limit applies, either side
MAX_ERR_NAMES = 16


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


def _mount_tmp(libc, spec: dict) -> None:
    """A fresh tmpfs at /tmp with a size and an inode count (the kernel bounds both), made while the harness still
    holds CAP_SYS_ADMIN in the sandbox's own user namespace (bubblewrap's tmpfs has no inode bound)."""
    import ctypes

    opts = f"size={int(spec['size'])},nr_inodes={int(spec['nr_inodes'])},mode=1777".encode()
    if libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 2 | 4, opts) != 0:  # MS_NOSUID | MS_NODEV
        raise OSError(ctypes.get_errno(), "mount of the private /tmp failed")
    os.chdir("/tmp")


def _drop_caps(libc) -> None:
    """Clear every capability (effective, permitted, inheritable; ambient goes with permitted) and check it."""
    import ctypes

    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")
    with open("/proc/self/status") as f:
        caps = {k: v.strip() for k, v in (line.split(":", 1) for line in f if line.startswith("Cap"))}
    if int(caps["CapEff"], 16) or int(caps["CapPrm"], 16):
        raise OSError("capabilities are still held")


def _lock_down(job: dict) -> None:
    """In order: the private /tmp; (privileged fallback) the slot uid; no capabilities; the late seccomp filter."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if job.get("tmpfs"):
        _mount_tmp(libc, job["tmpfs"])
    if job.get("drop_uid") is not None:
        _drop_uid(int(job["drop_uid"]))
    if job.get("late_filter"):
        _drop_caps(libc)
        _load_filter(libc, bytes.fromhex(job["late_filter"]))
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]


def _load_filter(libc, bpf: bytes) -> None:
    import ctypes

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # NO_NEW_PRIVS, SECCOMP
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")


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
    if t is int and not -_SMALL_INT < value < _SMALL_INT:
        return {"__t": "int", "v": hex(value)}
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


def decode(obj: object) -> object:
    """The parent's tagged arguments back to values (the parent only sends what ``encode`` makes)."""
    if type(obj) is list:
        return [decode(v) for v in obj]
    if type(obj) is not dict:
        return obj
    tag, v = obj["__t"], obj["v"]
    if tag == "int":
        return int(v, 16)
    if tag == "bytes":
        return bytes.fromhex(v)
    if tag == "complex":
        return complex(*v)
    if tag == "dict":
        return {decode(k): decode(x) for k, x in v}
    return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](decode(x) for x in v)


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


def _answer(q: int, src: str, args: list, ns: dict, results: dict) -> str:
    given = [decode(a) for a in args]
    try:
        value = eval(compile(src, "tests.py", "eval"), ns, {"__A": given, "__R": results})
    except BaseException as exc:  # SystemExit too: a call must not end the run
        names = [c.__name__ for c in type(exc).__mro__][:MAX_ERR_NAMES]
        try:
            msg = str(exc)[:200]  # the program's own text (KeyError's is the key's repr), as pytest's match reads
        except BaseException:
            msg = ""
        return json.dumps({"q": q, "err": type(exc).__name__, "mro": names, "msg": msg})
    out = {"q": q, "m": _mutated(args, given)}
    try:
        out["v"] = encode(value)
    except (TypeError, ValueError, RecursionError):
        results[q] = value
        out["ref"] = q
    return json.dumps(out)


def _mutated(sent: list, given: list) -> dict:
    """The arguments the call changed in place (a list sorted, a dict filled), by position, to be copied back."""
    changed = {}
    for i, (before, obj) in enumerate(zip(sent, given)):
        if type(obj) in (list, dict, set, bytearray):
            try:
                after = encode(obj)
            except (TypeError, ValueError, RecursionError):
                continue
            if after != before:
                changed[str(i)] = after
    return changed


def _serve(job_file, ns: dict) -> None:
    """Answer the parent's calls until it closes the job pipe."""
    results: dict = {}
    while True:
        line = job_file.readline()
        if not line:
            return
        req = json.loads(line)
        try:
            out = _answer(int(req["q"]), req["src"], req["a"], ns, results)
        except BaseException as exc:  # e.g. no memory left to encode the answer
            out = json.dumps({"q": req["q"], "err": type(exc).__name__, "mro": []})
        os.write(REPORT_FD[0], (out + "\n").encode())


def _drop_uid(uid: int) -> None:
    """Privileged fallback only: become the slot uid, which clears every capability; refuse to go on otherwise."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getgroups():
        raise OSError("could not drop to the sandbox uid")


def main(job: dict, job_file) -> None:
    REPORT_FD[0] = int(job["report_fd"])
    try:
        _lock_down(job)
        _set_limits(job["limits"])
        resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))
        resource.setrlimit(resource.RLIMIT_SIGPENDING, (64, 64))  # queued signals are kernel memory too
    except BaseException as exc:
        _report({"fatal": f"{type(exc).__name__}: {exc}"})
        os._exit(HARNESS_FAILED)
    sys.argv = ["solution.py"]
    sys.addaudithook(_hook)
    # in call mode the tests import the program (``from solution import f``): its main guard does not run
    ns = {"__name__": "solution" if job.get("serve") else "__main__", "__builtins__": builtins}
    status = _run_program(job["code"], ns)
    if status == 0 and job.get("serve"):
        _report({"ready": True})
        _serve(job_file, ns)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        status = status or 1
    _report({"exit": status})
    _report({"done": True})  # the parent reads this process's peak memory from /proc now, then closes the job pipe
    try:
        job_file.read()
    except BaseException:
        pass
    os._exit(status)


if __name__ == "__sandbox__":
    main(globals()["JOB"], globals()["JOB_FILE"])
