"""The benchmarks' `grpokit rollout` subprocess (bench_async.py, bench_sync_check.py): a free 127.0.0.1 port,
its output to a log file, optionally pinned to CPU cores (``taskset``), killed on exit."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned(cmd: list[str], cores: str | None) -> list[str]:
    """``cmd`` under ``taskset -c cores`` (util-linux), or as it is when ``cores`` is None."""
    return cmd if cores is None else ["taskset", "-c", cores, *cmd]


def can_pin(cores_needed: int = 2) -> bool:
    """``taskset`` exists and this process may run on at least ``cores_needed`` cores."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return shutil.which("taskset") is not None and allowed >= cores_needed


@contextlib.contextmanager
def rollout_server(
    model: str,
    log: Path,
    *args: str,
    threads: int = 1,
    cores: str | None = None,
    env: dict | None = None,
    start_timeout: float = 300,
):
    """Yield the port of a healthy `grpokit rollout --model model args...` (OMP_NUM_THREADS ``threads``, on
    ``cores`` when given); SystemExit with the end of its log when it does not come up."""
    port = free_port()
    cmd = pinned([sys.executable, "-m", "grpokit", "rollout", "--model", model, "--port", str(port), *args], cores)
    full_env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=full_env)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health/", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the rollout server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield port
    finally:
        proc.kill()
        proc.wait(timeout=30)
