"""Starting a real `grpokit rollout` subprocess on a free 127.0.0.1 port (shared by the test_server_* files), and
watching it from outside: its memory, its file descriptors, its health."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from cli_process import StartedGrpokit, free_port


@dataclass
class Server:
    proc: StartedGrpokit
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self, headers: dict | None = None) -> bool:
        resp = httpx.get(self.url + "/health/", headers=headers or {}, timeout=10)
        return resp.status_code == 200 and resp.json() == {"status": "ok"}


@contextlib.contextmanager
def rollout_server(model_dir: Path, log_dir: Path, *args: str, env: dict | None = None, start_timeout: float = 180):
    """A running server; always killed on exit. Fails with the server's log when it does not come up."""
    port = free_port()
    log = log_dir / f"rollout-{port}.log"
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    # `python -m grpokit rollout ...`, forked from the test zygote (cli_process.py): no interpreter start-up
    proc = StartedGrpokit(
        ["rollout", "--model", str(model_dir), "--port", str(port), *args], env=full_env, output=str(log)
    )
    server = Server(proc, port, log)
    headers = {"Authorization": f"Bearer {full_env['GRPOKIT_API_KEY']}"} if full_env.get("GRPOKIT_API_KEY") else {}
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"rollout server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(server.url + "/health/", headers=headers, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout server not up after {start_timeout}s:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield server
    finally:
        proc.kill()
        proc.wait(timeout=30)


@contextlib.contextmanager
def limited_server(
    model_dir: Path, log_path: Path, *args: str, key: str, memory_gb: int = 4, nofile: int | None = None
):
    """`grpokit rollout` (transformers, float32, API ``key``) under ``prlimit --as`` (and ``--nofile``): yields
    (process, url, port); killed on exit."""
    port = free_port()
    limits = [f"--as={memory_gb << 30}"] + ([f"--nofile={nofile}"] if nofile else [])
    cmd = [
        "prlimit",
        *limits,
        sys.executable,
        "-m",
        "grpokit",
        "rollout",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--torch_dtype",
        "float32",
        "--engine",
        "transformers",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "GRPOKIT_API_KEY": key}
    with open(log_path, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health/", headers=auth(key), timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.3)
        yield proc, url, port
    finally:
        proc.kill()
        proc.wait(30)


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def memory_kb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) in kB, of the python process under prlimit (prlimit execs it: same pid)."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0])
    return fields


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fds_settle(pid: int, target: int, within_s: float = 10.0, slack: int = 2) -> int:
    """Wait until the process holds at most ``target + slack`` descriptors; the count then (or at the deadline)."""
    deadline = time.monotonic() + within_s
    while True:
        n = open_fds(pid)
        if n <= target + slack or time.monotonic() > deadline:
            return n
        time.sleep(0.1)


def health_s(url: str, key: str) -> float:
    """Seconds a fresh connection's ``GET /health/`` takes (the answer must be ok); inf when it fails."""
    t0 = time.monotonic()
    try:
        resp = httpx.get(url + "/health/", headers=auth(key), timeout=5)
    except httpx.HTTPError:
        return float("inf")
    return time.monotonic() - t0 if resp.status_code == 200 and resp.json() == {"status": "ok"} else float("inf")
