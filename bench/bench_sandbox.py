"""Overhead of the code_exec sandbox: the bubblewrap + seccomp sandbox against the old one (unshare --net, uid
nobody, audit hook), taken from git at ``--old-rev``.

Two numbers per sandbox, on a trivial program (``print(int(input()) * 2)``):

- the median wall time of one execution, run one after another (``--repeats`` each, interleaved);
- executions per second with ``--slots`` running at once (threads, as ``code_exec_workers`` does), over
  ``--burst`` executions.

    python bench/bench_sandbox.py                      # as root, as CI runs
    python bench/bench_sandbox.py --repeats 60 --slots 8 --burst 160 --ballast-mb 2000
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = "print(int(input()) * 2)"


def load_old(rev: str):
    """The old ``sandbox.py`` and its child script from git, imported as a stand-alone module."""
    folder = Path(tempfile.mkdtemp(prefix="grpokit-old-sbx-"))
    folder.chmod(0o755)
    for name in ("sandbox.py", "_sandbox_child.py"):
        text = subprocess.run(["git", "show", f"{rev}:grpokit/rewards/{name}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout  # fmt: skip
        (folder / name).write_text(text)
        (folder / name).chmod(0o644)
    spec = importlib.util.spec_from_file_location("old_sandbox", folder / "sandbox.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_sandbox"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def runners(old_rev: str) -> dict:
    sys.path.insert(0, str(ROOT))
    from grpokit.rewards import sandbox

    old = load_old(old_rev)
    new_limits = sandbox.SandboxLimits(timeout_s=5, memory_mb=512)
    old_limits = old.SandboxLimits(timeout_s=5, memory_mb=512)

    def run_new() -> bool:
        return sandbox.run_job(PROGRAM, stdin="21\n", limits=new_limits).stdout == "42\n"

    def run_old() -> bool:
        return old.run_python(PROGRAM, stdin="21\n", limits=old_limits).stdout == "42\n"

    return {"old": run_old, "new": run_new}


def one(fn) -> float:
    start = time.perf_counter()
    if not fn():
        raise SystemExit("the sandbox did not run the program")
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old-rev", default="4bd70af", help="git revision with the old sandbox")
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--burst", type=int, default=80)
    p.add_argument("--ballast-mb", type=int, default=0, help="memory the parent holds, as a trainer with a model does")
    a = p.parse_args()
    ballast = bytearray(a.ballast_mb << 20)
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1  # touch every page: a fork has to copy its page tables
    fns = runners(a.old_rev)
    for fn in fns.values():
        one(fn)  # warm up (interpreter checks, filters)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(a.repeats):
        for k, fn in fns.items():
            times[k].append(one(fn))
    print(f"{'sandbox':8} {'median ms':>10} {'p90 ms':>8} {f'exec/s @{a.slots} slots':>18}")
    for k, fn in fns.items():
        start = time.perf_counter()
        with ThreadPoolExecutor(a.slots) as pool:
            ok = all(pool.map(lambda _: fn(), range(a.burst)))
        rate = a.burst / (time.perf_counter() - start)
        t = sorted(times[k])
        print(f"{k:8} {statistics.median(t) * 1e3:10.1f} {t[int(0.9 * (len(t) - 1))] * 1e3:8.1f} {rate:18.1f}"
              + ("" if ok else "  (some runs failed)"))


if __name__ == "__main__":
    main()
