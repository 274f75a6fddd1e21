"""Wall time of one RewardRunner.compute with I/O-bound async rewards: how much of their waiting overlaps.

Each async reward awaits ``--seconds`` (a stand-in for an HTTP judge), the optional sync reward sleeps as long on
the caller's thread. Run one after the other they would take (async rewards + sync reward) × seconds; the runner
awaits every async reward of a batch together, while the sync rewards run, so the ideal is one ``--seconds``.
Reported: the median over ``--repeats`` and its ratio to the sequential sum. The overlap itself is tested with
events, not timed, in tests/unit/test_rewards_runner.py.

    python bench/bench_rewards.py --async_rewards 4 --sync --seconds 0.2 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--async_rewards", type=int, default=4, help="number of async rewards")
    p.add_argument("--sync", action="store_true", help="add one sync reward that sleeps as long")
    p.add_argument("--seconds", type=float, default=0.2, help="each reward's wait")
    p.add_argument("--completions", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()

    from grpokit.rewards import RewardRunner

    def judge(value: float):
        async def call(completions, **kwargs):
            await asyncio.sleep(a.seconds)
            return [value] * len(completions)

        return call

    def rule(completions, **kwargs):
        time.sleep(a.seconds)
        return [0.0] * len(completions)

    funcs = [judge(float(i)) for i in range(a.async_rewards)] + ([rule] if a.sync else [])
    completions = ["x"] * a.completions
    times = []
    with RewardRunner(funcs, [f"r{i}" for i in range(len(funcs))]) as runner:
        runner.compute(completions, {})  # starts the event loop thread
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            runner.compute(completions, {})
            times.append(time.perf_counter() - t0)
    median, sequential = statistics.median(times), len(funcs) * a.seconds
    print(
        f"{a.async_rewards} async reward(s){' + 1 sync' if a.sync else ''}, {a.seconds:g} s each: "
        f"median {median:.3f} s per compute, {median / sequential:.2f}x of one after the other "
        f"({sequential:.3f} s); ideal {a.seconds / sequential:.2f}x"
    )


if __name__ == "__main__":
    main()
