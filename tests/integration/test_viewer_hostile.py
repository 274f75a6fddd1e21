"""`grpokit view` seen from outside its process: the memory it takes follows what the page shows, not the size of
the run's history, and `--serve` holds no thread per idle connection (300 of them leave it answering, with its
thread count where it was). Bounded: 40 MB of rows, 300 connections, every wait with a deadline."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.slow
PEAK_RSS = (
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def _big_run(path, steps: int, rows: int, row_bytes: int):
    path.mkdir()
    (path / "logging.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(steps)))
    with open(path / "completions.jsonl", "w") as f:
        for s in range(steps):
            for g in range(rows):
                f.write(json.dumps({"step": s, "group": str(g), "prompt": "p", "completion": "x" * row_bytes}) + "\n")
    return path


def test_the_page_costs_what_it_shows_not_the_history(tmp_path):
    run = _big_run(tmp_path / "run", steps=400, rows=10, row_bytes=10_000)  # 40 MB of completions
    size_mb = (run / "completions.jsonl").stat().st_size / 2**20
    cmd = [sys.executable, "-c", PEAK_RSS, sys.executable, "-m", "grpokit", "view", str(run)]
    cmd += ["--max_completion_steps", "10"]  # 1 MB of rows shown
    peak_mb = int(subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout) / 1024
    print(f"\nviewer: {size_mb:.0f} MB of completions, 10 steps shown, peak RSS {peak_mb:.0f} MB")
    assert peak_mb < 100, f"peak RSS {peak_mb:.0f} MB for a page of 1 MB of rows ({size_mb:.0f} MB read)"


def test_serve_holds_no_thread_per_idle_connection(tmp_path):
    run = _big_run(tmp_path / "run", steps=3, rows=2, row_bytes=100)
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpokit", "view", str(run), "--serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    socks = []
    try:
        proc.stdout.readline()  # the report's path
        base = re.search(r"(http://127\.0\.0\.1:(\d+))/", proc.stdout.readline())
        url, port = base.group(1), int(base.group(2))
        assert urllib.request.urlopen(url + "/data.json", timeout=30).status == 200
        threads = _threads(proc.pid)
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            socks.append(s)
        time.sleep(0.5)
        assert urllib.request.urlopen(url + "/version", timeout=10).status == 200
        assert _threads(proc.pid) <= threads + 2  # an event loop watches them; no thread each
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(timeout=30)


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
