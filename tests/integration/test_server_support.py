"""Starting a real `grpokit rollout` subprocess on a free 127.0.0.1 port (shared by the test_server_* files)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
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
    cmd = [sys.executable, "-m", "grpokit", "rollout", "--model", str(model_dir), "--port", str(port), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=full_env)
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
