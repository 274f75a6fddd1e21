"""On-policy distillation against GRPO alone on the demo's task, over several seeds.

First the built-in demo trains the teacher (``grpokit train --seed S0 --output_dir OUT/teacher``; or ``--teacher
FOLDER`` names one already trained). Then, for each seed, a fresh student trains twice: GRPO alone (the demo's
recipe) and with the teacher (``grpokit/config/demo_distill.yaml`` with ``--teacher_model OUT/teacher/final_model``).
Each run is scored greedily on the held-out split; the table gives held-out accuracy, training seconds (the loop
alone) and the held-out gain over the untrained student per minute of training. One run after the other, so each
has the machine to itself. Options after ``--`` go to every ``grpokit train`` (e.g. ``-- --max_steps 2`` for a
quick check of the script).

    python bench/bench_distill.py --seeds 42 1 2 [--out /tmp/distill] [--teacher FOLDER] [-- --max_steps 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_demo import held_out, held_out_split, run_seed  # noqa: E402 (the demo bench's runs and scoring)

from grpokit.config.parse import DEMO_YAML  # noqa: E402

DISTILL_YAML = DEMO_YAML.with_name("demo_distill.yaml")


def per_minute(row: dict, before: float) -> float:
    return (row["held_out"] - before) / max(row["train_s"] / 60, 1e-9)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    parser.add_argument("--teacher_seed", type=int, default=42)
    parser.add_argument("--out", type=Path, default=Path("/tmp/grpokit-bench-distill"))
    parser.add_argument("--teacher", type=Path, default=None, help="a trained teacher folder (default: train one)")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    dataset = held_out_split(DEMO_YAML)
    teacher = args.teacher
    if teacher is None:
        row = run_seed(args.teacher_seed, args.out / "teacher", extra, dataset)
        teacher = args.out / "teacher" / f"seed-{args.teacher_seed}" / "final_model"
        print(json.dumps({"teacher": str(teacher), **row}), flush=True)
    before = held_out(None, dataset)
    print(f"untrained student: held-out {before:.2f} on {dataset}", flush=True)
    recipes = {"grpo": extra, "distill": ["--config", str(DISTILL_YAML), "--teacher_model", str(teacher), *extra]}
    rows: dict[str, list[dict]] = {name: [] for name in recipes}
    for seed in args.seeds:
        for name, options in recipes.items():
            row = run_seed(seed, args.out / name, options, dataset)
            rows[name].append(row)
            print(json.dumps({"recipe": name, **row, "gain_per_min": round(per_minute(row, before), 3)}), flush=True)
    for name, runs in rows.items():
        accs = [r["held_out"] for r in runs]
        gains = [per_minute(r, before) for r in runs]
        print(
            f"{name}: held-out {' / '.join(f'{a:.2f}' for a in accs)} (mean {statistics.mean(accs):.3f}); "
            f"training {min(r['train_s'] for r in runs)}-{max(r['train_s'] for r in runs)} s; "
            f"gain per minute {statistics.mean(gains):.3f}"
        )


if __name__ == "__main__":
    main()
