"""Red team for the code_exec sandbox (issue 17): 83 hostile programs across the issue's 8 classes, each result
checked from outside the sandbox: marker files on the host, connections reaching loopback/unix listeners, the
process table, secrets in the output, and the scores (hostile = wrong answers score 0, while right answers run
beside them and score 1). The listeners bind 127.0.0.1 / a unix path / an abstract name only; every loop here is
bounded in count and time."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sandbox_redteam_programs import CLASSES, SECRETS, SPOOF, WRONG, render

from grpokit.rewards import grader, isolation
from grpokit.rewards.code_exec import CodeExecReward
from grpokit.rewards.sandbox import SandboxLimits, Session, live_sandbox_processes, run_job

try:
    isolation.resolve("bwrap")
    _MISSING = None
except OSError as exc:
    _MISSING = str(exc)
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))

RIGHT = "def f(n):\n    return 2 ** n - 1\n"
TESTS = "expected = 8191\nassert f(13) == expected\nassert f(5) == 31\nassert abs(f(1) - 1) < 1e-9"
HOST_LEFTOVERS = ("/etc/grpokit-w2", "/etc/grpokit-w3", "/etc/grpokit-w4", "/etc/grpokit-w6", "/usr/grpokit-w6",
                  "/grpokit-w6", "/usr/grpokit-w8", "/dev/shm/grpokit-w7", "/dev/grpokit-w7")  # fmt: skip


class Outside:
    """What the sandbox must not reach: a host dir, three listeners, and a process with a secret command line."""

    def __init__(self) -> None:
        self.host = Path(tempfile.mkdtemp(prefix="grpokit-rt-"))
        os.chmod(self.host, 0o777)
        self.secret = f"grpokit-secret-{uuid.uuid4().hex}"
        self.abstract = f"grpokit-rt-{uuid.uuid4().hex}"
        self.connections = 0
        self.stop = threading.Event()
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind(str(self.host / "listener.sock"))
        os.chmod(self.host / "listener.sock", 0o777)
        self.abs = socket.socket(socket.AF_UNIX)
        self.abs.bind("\0" + self.abstract)
        for s in (self.tcp, self.unix, self.abs):
            s.listen(16)
            s.settimeout(0.2)
            threading.Thread(target=self._accept, args=(s,), daemon=True).start()
        self.helper = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)", "--vllm_server_api_key", self.secret],
            env={**os.environ, "GRPOKIT_API_KEY": self.secret})  # fmt: skip

    def _accept(self, s: socket.socket) -> None:
        deadline = time.monotonic() + 1800
        while not self.stop.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = s.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def values(self) -> dict[str, str]:
        return {"HOST": str(self.host), "PORT": str(self.tcp.getsockname()[1]),
                "UNIX": str(self.host / "listener.sock"), "ABSTRACT": self.abstract}  # fmt: skip

    def escapes(self) -> list[str]:
        found = [f"host file {p.name}" for p in self.host.iterdir() if p.name != "listener.sock"]
        found += [f"host file {p}" for p in HOST_LEFTOVERS if os.path.lexists(p)]
        found += [f"{self.connections} connection(s) reached a listener"] * bool(self.connections)
        found += [f"sandbox processes alive: {live_sandbox_processes()}"] * bool(live_sandbox_processes())
        if self.helper.poll() is not None:
            found.append("a host process was killed")
        return found

    def close(self) -> None:
        self.stop.set()
        self.helper.kill()
        self.helper.wait()
        for s in (self.tcp, self.unix, self.abs):
            s.close()
        shutil.rmtree(self.host, ignore_errors=True)


@pytest.fixture(scope="module")
def outside():
    o = Outside()
    yield o
    o.close()


@pytest.fixture(scope="module")
def reward():
    return CodeExecReward(code_exec_timeout=3, code_exec_memory_mb=256, code_exec_workers=4)  # slack for a busy host


def _programs(name: str, outside: Outside) -> list[tuple[str, str]]:
    progs = CLASSES[name]
    out = [(k, render(c, **outside.values()) + ("" if progs is SPOOF else WRONG)) for k, c in progs.items()]
    for key, code in out:
        compile(code, key, "exec")  # a program that does not even parse would "pass" for nothing
    return out


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_class_holds(name, outside, reward, monkeypatch):
    monkeypatch.setenv("GRPOKIT_API_KEY", outside.secret)  # the trainer's own secret must not leak in either
    progs = _programs(name, outside)
    completions, tests = [], []
    for _, code in progs:  # every hostile program runs beside a right answer
        completions += [code, RIGHT]
        tests += [TESTS, TESTS]
    start = time.monotonic()
    scores = reward(completions, test_cases=tests)
    returned = time.monotonic()
    assert live_sandbox_processes() == [], "a sandbox process outlived the call"
    hostile = {k: s for (k, _), s in zip(progs, scores[0::2])}
    assert {k: s for k, s in hostile.items() if s != 0.0} == {}, "a wrong answer scored above 0"
    assert scores[1::2] == [1.0] * len(progs), "a right answer lost points to a hostile batch-mate"
    time.sleep(max(0.0, 1.0 - (time.monotonic() - returned)))
    assert outside.escapes() == []
    assert time.monotonic() - start < 60 + 3 * len(progs)


@pytest.mark.parametrize("key", sorted(SECRETS))
def test_secrets_stay_outside(key, outside, monkeypatch):
    monkeypatch.setenv("GRPOKIT_API_KEY", outside.secret)
    res = run_job(render(SECRETS[key], **outside.values()), limits=SandboxLimits(timeout_s=2, memory_mb=256))
    assert res.status == "ok", res.stderr
    assert outside.secret not in res.stdout + res.stderr
    assert "--vllm_server_api_key" not in res.stdout


def test_disk_use_is_bounded(outside):
    code = render(CLASSES["8_disk"]["many_files"], **outside.values())
    res = run_job(code, limits=SandboxLimits(timeout_s=5, memory_mb=256))
    wrote = int(res.stdout.split("WROTE")[-1])
    assert 0 < wrote <= SandboxLimits().max_disk_bytes, res.stdout
    assert "No space left on device" in res.stdout


def test_statuses_say_what_happened(outside):
    lim = SandboxLimits(timeout_s=1, memory_mb=128)
    assert run_job("import os\nos.fork()", limits=lim).status == "error"  # the audit hook's PermissionError
    assert (
        run_job(render(CLASSES["2_audit_hook_off"]["ctypes_fork_syscall"], **outside.values()), limits=lim).status
        == "crash"
    )  # killed by seccomp (SIGSYS): a signal, which the parent cannot tell from os._exit(159)
    assert run_job("while True:\n    pass", limits=lim).status == "timeout"
    assert run_job("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\nprint(1)", limits=lim).status == "ok"
    # (the program is pid 1 of its namespace: it cannot even kill itself)


@pytest.mark.skipif(os.geteuid() != 0, reason="finds the sandbox by its slot uid")
def test_killed_from_outside_is_not_a_timeout():
    out = {}
    t = threading.Thread(target=lambda: out.update(res=run_job("import time\ntime.sleep(8)",
                                                              limits=SandboxLimits(timeout_s=6))))  # fmt: skip
    t.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(live_sandbox_processes()) < 2:
        time.sleep(0.05)
    time.sleep(0.3)
    for pid in live_sandbox_processes():
        os.kill(pid, 9)
    t.join(timeout=10)
    assert out["res"].status == "crash"  # a signal from outside: neither a timeout nor the program's choice
    assert out["res"].elapsed_s < 5


def test_the_checks_see_escapes_without_isolation(outside):
    """Control: with --code_exec_isolation none the same checks do catch escapes, so 0 above means 0."""
    unsafe = CodeExecReward(code_exec_timeout=2, code_exec_memory_mb=256, code_exec_isolation="none")
    progs = [c for k, c in _programs("3_writes_outside", outside) if k == "plain_open"]
    progs += [c for k, c in _programs("5_unix_sockets_network", outside) if k == "tcp_loopback_no_hook"]
    progs.append(CLASSES["7_spoofed_results"]["read_tests_file"])  # no test file to read even here: 0
    before = outside.connections
    assert unsafe(progs, test_cases=[TESTS] * 3) == [0.0, 0.0, 0.0]
    try:
        found = outside.escapes()
        assert any("host file w1" in f for f in found) and outside.connections > before
    finally:
        for p in outside.host.iterdir():
            if p.name != "listener.sock":
                p.unlink()
        outside.connections = before


@pytest.mark.skipif(os.geteuid() != 0, reason="the fallback is for root without unprivileged user namespaces")
def test_privileged_fallback_holds(outside):
    """Root running bubblewrap itself (no user namespace; the harness drops to the slot uid) holds as well."""
    rt = dataclasses.replace(isolation.resolve("bwrap"), privileged=True)
    program = grader.prepare(TESTS)
    picked = [
        c
        for name in (
            "1_process_creation",
            "2_audit_hook_off",
            "3_writes_outside",
            "4_survivors",
            "5_unix_sockets_network",
            "7_spoofed_results",
        )
        for _, c in _programs(name, outside)
    ]

    def score(code: str) -> int:
        deadline = time.monotonic() + 3
        with Session(code, SandboxLimits(timeout_s=2), rt, serve=True, deadline=deadline) as s:
            return grader.grade(program, s.call, deadline).passed if s.ready else 0

    with ThreadPoolExecutor(4) as pool:
        scores = list(pool.map(score, picked + [RIGHT]))
    assert scores == [0] * len(picked) + [3]
    assert live_sandbox_processes(rt) == []
    assert outside.escapes() == []
    uid = run_job("import os\nprint(os.getresuid(), os.getgroups())", rt=rt).stdout
    assert "0" not in uid.split("(")[1].split(")")[0].split(", ") and "[]" in uid
