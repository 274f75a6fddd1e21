"""A built-in demo over several seeds: train time and held-out greedy accuracy before and after.

Each seed runs ``grpokit train --seed S --output_dir OUT/seed-S`` (the demo: no --model, no --dataset; or
``--config FILE``, e.g. the harder demo ``grpokit/config/demo_subtraction.yaml``; extra options after ``--`` change
the recipe, e.g. ``-- --learning_rate 5e-4``), then ``grpokit infer`` with the final model on the held-out split
(the config's first ``val_dataset``; greedy). One after the other, so each run has the machine to itself.
docs/PERFORMANCE.md ("The demo") quotes the figures.

    python bench/bench_demo.py --seeds 42 1 2 3 4 [--out /tmp/demo] [-- --learning_rate 5e-4 ...]
    python bench/bench_demo.py --config grpokit/config/demo_subtraction.yaml --seeds 42 1 2 --before
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from grpokit.config.parse import DEMO_YAML  # `grpokit train`'s recipe

ACCURACY = re.compile(r"accuracy (\d+\.\d+)")
ELAPSED = re.compile(r"(?:(\d+)m)?(\d+)s elapsed")


def _grpokit(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "grpokit", *args], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"grpokit {' '.join(args)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return proc.stdout + proc.stderr


def held_out(model: str | None, dataset: str) -> float:
    out = _grpokit("infer", "--dataset", dataset, *(["--model", model] if model else []))
    return float(ACCURACY.findall(out)[-1])


def held_out_split(config: Path) -> str:
    """The split `grpokit infer` scores: the config's first val_dataset."""
    val = yaml.safe_load(config.read_text()).get("val_dataset")
    if not val:
        raise SystemExit(f"{config}: no val_dataset to score the trained model on")
    return val if isinstance(val, str) else val[0]


def run_seed(seed: int, out: Path, extra: list[str], dataset: str) -> dict:
    folder = out / f"seed-{seed}"
    t0 = time.perf_counter()
    log = _grpokit("train", "--seed", str(seed), "--output_dir", str(folder), *extra)
    wall = time.perf_counter() - t0
    minutes, seconds = ELAPSED.findall(log)[-1]  # the progress bar's last reading: the training loop alone
    rows = [json.loads(line) for line in (folder / "logging.jsonl").read_text().splitlines()]
    rewards = [row["reward"] for row in rows if "reward" in row]  # (the demo's evaluation rows have none)
    return {
        "seed": seed,
        "train_s": 60 * int(minutes or 0) + int(seconds),
        "wall_s": round(wall, 1),
        "reward_first": round(statistics.mean(rewards[:4]), 3),
        "reward_last": round(statistics.mean(rewards[-4:]), 3),
        "held_out": held_out(str(folder / "final_model"), dataset),
    }


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2, 3, 4])
    parser.add_argument("--out", type=Path, default=Path("/tmp/grpokit-bench-demo"))
    parser.add_argument("--config", type=Path, default=None, help="a demo's yaml (default: the built-in demo)")
    parser.add_argument("--before", action="store_true", help="also score the untrained model")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    dataset = held_out_split(args.config or DEMO_YAML)
    if args.config is not None:
        extra = ["--config", str(args.config), *extra]
    print(f"recipe: the demo{' with ' + ' '.join(extra) if extra else ''}", flush=True)
    if args.before:
        print(f"before: held-out {held_out(None, dataset):.2f} on {dataset}", flush=True)
    rows = []
    for seed in args.seeds:
        rows.append(run_seed(seed, args.out, extra, dataset))
        print(json.dumps(rows[-1]), flush=True)
    accs = [r["held_out"] for r in rows]
    print(
        f"held-out: {' / '.join(f'{a:.2f}' for a in accs)} (mean {statistics.mean(accs):.3f}, min {min(accs):.2f}); "
        f"training {min(r['train_s'] for r in rows)}-{max(r['train_s'] for r in rows)} s"
    )


if __name__ == "__main__":
    main()
