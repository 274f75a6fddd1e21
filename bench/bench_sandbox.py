"""Throughput of the code_exec sandbox: this tree against an older revision (``--old-rev``), run back to back.

Each side runs in its own interpreter (the old revision's ``grpokit`` is taken from git with ``git archive``, so
nothing of this tree mixes in), alternating for ``--rounds`` rounds on the same loaded machine. Per side:

- ``median ms`` / ``p90 ms``: one execution of a trivial program (``print(int(input()) * 2)``), one after another;
- ``exec/s``: stdin executions per second with ``--slots`` running at once (threads, as ``code_exec_workers``);
- ``asserts samples/s``: whole ``code_exec`` samples per second graded against three asserts, ``--slots`` workers;
- ``cpu ms``: CPU time (trainer and sandboxes, user + system) per stdin execution and per assert sample: on a
  machine that other work loads, the steadier measure of what each costs.

    python bench/bench_sandbox.py                         # as root, as CI runs
    python bench/bench_sandbox.py --old-rev 86d38b3 --rounds 3 --slots 4 --burst 40
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MEASURE = r"""
import json, resource, statistics, sys, time
from concurrent.futures import ThreadPoolExecutor
from grpokit.rewards.sandbox import SandboxLimits, run_python
from grpokit.rewards.code_exec import CodeExecReward
repeats, slots, burst, ballast_mb = map(int, sys.argv[1:5])
ballast = bytearray(ballast_mb << 20)
for i in range(0, len(ballast), 4096):
    ballast[i] = 1  # touch every page: a fork has to copy its page tables
lim = SandboxLimits(timeout_s=5, memory_mb=512)
def one():
    start = time.perf_counter()
    if run_python("print(int(input()) * 2)", stdin="21\n", limits=lim).stdout != "42\n":
        raise SystemExit("the sandbox did not run the program")
    return time.perf_counter() - start
def cpu():
    return sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
one()
times = sorted(one() for _ in range(repeats))
start, c0 = time.perf_counter(), cpu()
with ThreadPoolExecutor(slots) as pool:
    list(pool.map(lambda _: one(), range(burst)))
rate, cpu_exec = burst / (time.perf_counter() - start), (cpu() - c0) / burst
reward = CodeExecReward(code_exec_timeout=5, code_exec_memory_mb=512, code_exec_workers=slots)
tests = "assert f(13) == 8191\nassert f(5) == 31\nassert [f(i) for i in range(3)] == [0, 1, 3]"
start, c0 = time.perf_counter(), cpu()
scores = reward(["def f(n):\n    return 2 ** n - 1\n"] * burst, test_cases=[tests] * burst)
samples, cpu_sample = burst / (time.perf_counter() - start), (cpu() - c0) / burst
assert scores == [1.0] * burst, scores
print(json.dumps({"median": statistics.median(times), "p90": times[int(0.9 * (len(times) - 1))],
                  "rate": rate, "samples": samples, "cpu_exec": cpu_exec, "cpu_sample": cpu_sample}))
"""


def snapshot(rev: str) -> Path:
    """The revision's ``grpokit`` package in a temporary folder (readable by sandbox users)."""
    folder = Path(tempfile.mkdtemp(prefix="grpokit-bench-"))
    folder.chmod(0o755)
    archive = subprocess.run(["git", "archive", rev, "grpokit"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def measure(tree: Path, a) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(a.repeats), str(a.slots), str(a.burst),
                          str(a.ballast_mb)], env=env, capture_output=True, text=True, cwd="/")  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"bench on {tree} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old-rev", default="86d38b3", help="git revision to compare with (before issue 28)")
    p.add_argument("--rounds", type=int, default=3, help="alternating old/new runs")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--burst", type=int, default=40)
    p.add_argument("--ballast-mb", type=int, default=0, help="memory each side's parent holds, as a trainer does")
    a = p.parse_args()
    old = snapshot(a.old_rev)
    try:
        runs: dict[str, list[dict]] = {"old": [], "new": []}
        for _ in range(a.rounds):
            runs["old"].append(measure(old, a))
            runs["new"].append(measure(ROOT, a))
    finally:
        shutil.rmtree(old, ignore_errors=True)
    print(
        f"{'sandbox':8} {'median ms':>10} {'p90 ms':>8} {f'exec/s @{a.slots}':>12} {'cpu ms/exec':>12} "
        f"{f'assert samples/s @{a.slots}':>25} {'cpu ms/sample':>14}"
    )
    for side, rs in runs.items():
        m = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(
            f"{side:8} {m['median'] * 1e3:10.1f} {m['p90'] * 1e3:8.1f} {m['rate']:12.1f} {m['cpu_exec'] * 1e3:12.1f} "
            f"{m['samples']:25.1f} {m['cpu_sample'] * 1e3:14.1f}"
        )


if __name__ == "__main__":
    main()
