"""The trainer's --agent endpoint seen from outside a real run (`grpokit train --agent` under `prlimit
--nofile=1024`, tiny model, 127.0.0.1): while the first episode waits, 1,100 idle connections and 50 that stop
inside their headers are opened to the endpoint (any local process can); the run must go on training, its agents'
next calls answered, its descriptors below the limit, its log free of per-connection accept errors, and it must end
with every step logged and its checkpoints written. Every client is bounded in count and time."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from agents_fakes import agent_run_argv
from test_server_support import open_fds

from grpokit.testing import build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit")]
NOFILE = 1024
PATIENT_AGENT = textwrap.dedent("""
    import asyncio
    import os
    import pathlib

    from grpokit.agents import agents

    FLAGS = pathlib.Path(os.environ["GRPOKIT_TEST_FLAGS"])

    @agents.register("patient")
    async def patient(client, row):
        await client.chat.completions.create(model="any", messages=row["messages"], max_tokens=4)
        if not (FLAGS / "url").exists():  # the first episode says where the endpoint is, and waits for the flood
            (FLAGS / "url.tmp").write_text(str(client.base_url))
            os.replace(FLAGS / "url.tmp", FLAGS / "url")
        for _ in range(600):  # every episode waits (at most 60 s): the flood lands while the rollout is open
            if (FLAGS / "flooded").exists():
                break
            await asyncio.sleep(0.1)
        r = await client.chat.completions.create(model="any", messages=row["messages"], max_tokens=4)
        return float(len(r.choices[0].message.content or "") % 2)
""")


def test_a_flood_of_idle_connections_leaves_the_run_training(tmp_path):
    flags = tmp_path / "flags"
    flags.mkdir()
    model = build_tiny_model(tmp_path / "tiny")
    argv, out = agent_run_argv(model, tmp_path, PATIENT_AGENT, "patient", 1, "--save_steps", "1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "GRPOKIT_TEST_FLAGS": str(flags)}
    log = tmp_path / "train.log"
    with open(log, "wb") as sink:
        cmd = ["prlimit", f"--nofile={NOFILE}", sys.executable, "-m", "grpokit", "train", *argv]
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env)
    socks: list[socket.socket] = []
    try:
        port = _endpoint_port(proc, flags, log)
        for i in range(1150):  # 1,100 that send nothing, 50 that stop inside their headers
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
            if i >= 1100:
                time.sleep(0.001)
                try:
                    s.send(b"POST /episodes/x/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                except OSError:
                    pass  # evicted already: the server made room
        peak = open_fds(proc.pid)
        (flags / "flooded").write_text("1")
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        for s in socks:
            s.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    text = log.read_text()
    assert peak < NOFILE - 64, peak  # descriptors left for the run's own files
    assert "Too many open files" not in text and text.count("Traceback") == 0, text[-3000:]
    logged = [line for line in (out / "logging.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(logged) == 1
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-1"]


def _endpoint_port(proc: subprocess.Popen, flags, log) -> int:
    """The endpoint's port, from the first episode's base_url (bounded: 300 s, the run's start-up included)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        url = flags / "url"
        if url.exists():
            return int(re.match(r"http://127\.0\.0\.1:(\d+)/", url.read_text()).group(1))
        time.sleep(0.2)
    raise AssertionError(f"no episode started within 300 s:\n{log.read_text()[-3000:]}")
