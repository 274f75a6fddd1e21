"""Synchronous against asynchronous training (--max_staleness K) on a long-tail workload, side by side in one run.

Starts one `grpokit rollout` server (transformers engine, subprocess, 127.0.0.1, free port) and trains the same
settings once per mode against it (``--modes sync,1,2,4,2p``: ``--max_staleness`` 0, 1, 2, 4 with
``--staleness_policy wait``, ``Kp``: K with ``--partial_rollouts true``, ``Kg``: K with ``--stream_groups
true``). Reports wall time per 100 trained groups (a group: one prompt's ``--num_generations`` completions) from
the optimizer steps' end times, the first step excluded, its ratio to sync, and the logged
``async/staleness_mean`` (steps between the weights that sampled a completion and those it trains) and
``async/wait_s`` (the loop waiting for a window) of each mode, means over the same steps.

The workload (``--workload longtail``, the default): completion lengths are drawn per row from a heavy-tailed
distribution, ``--long_fraction`` (10%) of the rows at ``--max_completion_length`` and the rest short (geometric,
mean ``--short_mean``, default an eighth of the limit). The server's plugin (bench/bench_async_plugin.py) masks
EOS before a row's length and forces it there; the length is a hash of the prompt and the row's index in its
group, so every mode sees the same lengths. Nothing is simulated: the served model decodes every token, and the
trainer trains on them (reward ``token_parity``, which varies within groups). A batch of rows decodes until its
longest row ends, so most windows take the full limit while most of their completions are short: the long tail
that a synchronous loop waits for. ``--workload sampled`` leaves the lengths as the model samples them (the old
comparison of this script: ``--workload sampled --modes sync,1 --max_completion_length 16``).

The model (``--model tiny``): a random Qwen3-style model built here, hidden 256 and 2 layers (1.31M parameters)
by default, where one window's generation and one step's training take about the same time on a CPU core (on
bench_step.py's tiny model, hidden 128, training takes 0.7 of generation, which caps the overlap lower).

Placement: with ``taskset`` (util-linux) and two cores, the server runs on core 0 and the trainer on core 1
(``--pin auto``), each with OMP_NUM_THREADS 1, so the asynchronous modes overlap generation and training on
separate cores; the synchronous mode leaves one of them idle at any time. An untimed 3-step run goes first (the
server's first batches), and ``--rounds`` runs every mode again, each round starting one mode later.

Partial rollouts (mode ``2p``): each weight sync interrupts the server's running generation at its next token,
loads the weights and continues the paused rows on them, so a sync no longer waits for the rollout in flight.

    python bench/bench_async.py --steps 26 --rounds 3                # docs/PERFORMANCE.md's table, ~5 minutes
    python bench/bench_async.py --model DIR --device cuda --torch_dtype bfloat16 --rounds 1   # gpu_check.sh
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLUGIN = HERE / "bench_async_plugin.py"


def parse_modes(text: str) -> list[tuple[int, bool, bool]]:
    """``sync,1,2,4,2p,2g`` -> [(0, False, False), (1, False, False), ..., (2, True, False), (2, False, True)]:
    (``--max_staleness``, ``--partial_rollouts``, ``--stream_groups``); ``sync`` is ``--max_staleness 0``, a K
    followed by ``p`` adds partial rollouts and by ``g`` streaming groups (``2pg``: both)."""
    modes = []
    for part in text.split(","):
        part = part.strip()
        digits = part.rstrip("pg")
        flags = part[len(digits) :]
        if part == "sync":
            modes.append((0, False, False))
        elif digits.isdigit() and (int(digits) > 0 or not flags) and len(set(flags)) == len(flags):
            modes.append((int(digits), "p" in flags, "g" in flags))
        else:
            raise SystemExit(f"--modes {text}: {part!r} is neither sync, a number of steps, nor K ≥ 1 followed by p/g")
    return modes


def mode_name(mode: tuple[int, bool, bool]) -> str:
    k, partial, groups = mode
    if k == 0:
        return "sync"
    name = f"K = {k}" + (" with partial rollouts" if partial else " without partial rollouts" if k > 1 else "")
    return name + (", streaming groups" if groups else "")


def train(
    a: argparse.Namespace,
    model: str,
    port: int,
    out: Path,
    mode: tuple[int, bool, bool],
    cores: str | None,
    steps: int | None = None,
) -> dict:
    """One training run at ``mode`` (``--max_staleness``, ``--partial_rollouts``; ``steps``, default ``--steps``):
    its step end times and logged rows."""
    from bench_server import pinned

    cmd = [
        sys.executable,
        "-m",
        "grpokit",
        "train",
        "--model",
        model,
        "--dataset",
        "builtin:arithmetic",
        "--reward_funcs",
        "token_parity",
        "--vllm_mode",
        "server",
        "--vllm_server_host",
        "127.0.0.1",
        "--vllm_server_port",
        str(port),
        "--max_steps",
        str(steps or a.steps),
        "--num_generations",
        str(a.num_generations),
        "--per_device_train_batch_size",
        str(a.batch),
        "--max_completion_length",
        str(a.max_completion_length),
        "--output_dir",
        str(out),
        "--save_final_model",
        "false",
        "--save_steps",
        "100000",
        "--plots",
        "false",
        "--beta",
        "0",
        "--torch_dtype",
        a.torch_dtype,
        "--max_staleness",
        str(mode[0]),
        "--staleness_policy",
        "wait",
        "--seed",
        "0",
        "--check_weight_sync",
        a.check_weight_sync,
        "--external_plugins",
        str(PLUGIN),
        "--callbacks",
        "step_stamps",
        "--partial_rollouts",
        str(mode[1]).lower(),
        "--stream_groups",
        str(mode[2]).lower(),
    ]
    if a.lora:
        cmd += ["--tuner_type", "lora", "--lora_rank", "16", "--lora_alpha", "32", "--learning_rate", "2e-4"]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.trainer_threads), "TOKENIZERS_PARALLELISM": "false"}
    log_path = out.parent / f"{out.name}.log"
    with open(log_path, "wb") as log:
        done = subprocess.run(pinned(cmd, cores), env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"training at {mode_name(mode)} failed:\n{log_path.read_text()[-3000:]}")
    stamps = [float(x) for x in (out / "step_stamps.txt").read_text().split()]
    rows = [json.loads(x) for x in (out / "logging.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing/rollout" in r]  # the per-step rows (not the run summary)
    return {"stamps": stamps, "rows": rows}


def summarise(run: dict, groups_per_step: float) -> dict:
    """Per 100 groups and the means of the logged metrics, over the steps after the first."""
    stamps, rows = run["stamps"], run["rows"][1:]
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in rows)  # noqa: E731 - sync logs no async/*
    return {
        "s_per_100": (stamps[-1] - stamps[0]) / ((len(stamps) - 1) * groups_per_step) * 100,
        "staleness": mean("async/staleness_mean"),
        "staleness_max": max(r.get("async/staleness_max", 0) for r in rows),
        "wait": mean("async/wait_s"),
        "idle": mean("async/producer_idle_s"),
        "rollout": mean("timing/rollout"),
        "train": mean("timing/train") + mean("timing/logps"),
        "sync": mean("timing/sync"),
        "length": mean("completions/mean_length"),
        "clipped": mean("completions/clipped_ratio"),
    }


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="tiny",
        help="tiny (a Qwen3-style model built here: --hidden, --layers), smollm, or a model folder",
    )
    p.add_argument("--hidden", type=int, default=256, help="tiny: hidden size (bench_step.py's tiny is 128)")
    p.add_argument("--layers", type=int, default=2, help="tiny: layers")
    p.add_argument(
        "--modes",
        default="sync,1,2,4,2p",
        help="comma-separated: sync, --max_staleness values, and K followed by p (partial rollouts), g (streaming "
        "groups) or both",
    )
    p.add_argument("--steps", type=int, default=26, help="optimizer steps per mode (the first is not timed)")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="runs of every mode, interleaved (sync, 1, 2, 4, then 1, 2, 4, sync, ...); the table gives medians",
    )
    p.add_argument("--batch", type=int, default=16, help="completions per optimizer step")
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--max_completion_length", type=int, default=128)
    p.add_argument("--workload", default="longtail", choices=["longtail", "sampled"])
    p.add_argument("--long_fraction", type=float, default=0.1, help="longtail: rows that run to the limit")
    p.add_argument(
        "--short_mean",
        type=float,
        default=None,
        help="longtail: the other rows' mean length (default max_completion_length / 8)",
    )
    p.add_argument(
        "--pin",
        default="auto",
        choices=["auto", "on", "off"],
        help="server on core 0, trainer on core 1 (taskset); auto: when taskset and 2 cores exist",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: both processes on the GPU")
    p.add_argument("--torch_dtype", default="float32")
    p.add_argument(
        "--check_weight_sync",
        default="true",
        choices=["true", "false"],
        help="the trainer's --check_weight_sync (its probe is a server generation: it queues behind a "
        "rollout in flight)",
    )
    p.add_argument("--lora", action="store_true")
    p.add_argument("--trainer_threads", type=int, default=1)
    p.add_argument("--server_threads", type=int, default=1)
    a = p.parse_args()
    modes = parse_modes(a.modes)
    if a.steps < 3:
        raise SystemExit("--steps: at least 3 (the first is not timed)")
    if a.batch % a.num_generations:
        raise SystemExit(f"--batch {a.batch}: a multiple of --num_generations {a.num_generations}")
    sys.path.insert(0, str(HERE))
    from bench_server import can_pin, rollout_server
    from bench_step import resolve_model

    pin = a.pin == "on" or (a.pin == "auto" and can_pin(2))
    server_cores, trainer_cores = ("0", "1") if pin else (None, None)
    work = Path(tempfile.mkdtemp(prefix="grpokit-async-"))
    if a.model == "tiny":
        from grpokit.testing import build_tiny_model

        model = str(build_tiny_model(work / "model", hidden_size=a.hidden, num_layers=a.layers))
    else:
        model = resolve_model(a.model, work)
    short_mean = a.short_mean if a.short_mean is not None else a.max_completion_length / 8
    env = {
        "GRPOKIT_BENCH_LONGTAIL": "1" if a.workload == "longtail" else "0",
        "GRPOKIT_BENCH_LONG_FRACTION": str(a.long_fraction),
        "GRPOKIT_BENCH_SHORT_MEAN": str(short_mean),
    }
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(env)  # the trainers inherit it (the plugin reads it only in the server)
    load_before = loadavg()
    t0 = time.monotonic()
    with rollout_server(
        model,
        work / "server.log",
        "--torch_dtype",
        a.torch_dtype,
        "--engine",
        "transformers",
        "--external_plugins",
        str(PLUGIN),
        threads=a.server_threads,
        cores=server_cores,
    ) as port:
        # untimed: the server's first batches (allocations, code paths warming up) would fall on the first mode
        train(a, model, port, work / "warmup", modes[0], trainer_cores, steps=3)
        runs: dict[tuple[int, bool, bool], list[dict]] = {m: [] for m in modes}
        for r in range(a.rounds):  # interleaved, each round starting one mode later: a change of the machine's
            for m in modes[r % len(modes) :] + modes[: r % len(modes)]:  # load falls on every mode alike
                folder = work / f"k{m[0]}{'p' if m[1] else ''}{'g' if m[2] else ''}_r{r}"
                runs[m].append(train(a, model, port, folder, m, trainer_cores))
    load_after = loadavg()
    groups = a.batch / a.num_generations
    per_round = {k: [summarise(run, groups) for run in rs] for k, rs in runs.items()}
    res = {k: {f: statistics.median(x[f] for x in rs) for f in rs[0]} for k, rs in per_round.items()}
    workload = (
        f"long tail: {a.long_fraction:.0%} of completions at {a.max_completion_length} tokens, the rest "
        f"geometric with mean {short_mean:g}"
        if a.workload == "longtail"
        else f"lengths as sampled, at most {a.max_completion_length}"
    )
    placement = "server on core 0, trainer on core 1 (taskset)" if pin else "not pinned"
    print(
        f"model {f'tiny (hidden {a.hidden}, {a.layers} layers)' if a.model == 'tiny' else a.model} ({a.device}, "
        f"{a.torch_dtype}); {a.batch} completions ({groups:g} groups) per step, {a.steps} steps per mode, first "
        f"excluded; {a.rounds} round(s), medians; {workload}; {placement}; OMP threads trainer "
        f"{a.trainer_threads}, server {a.server_threads}; "
        f"load average {load_before} before, {load_after} after; {time.monotonic() - t0:.0f} s in all"
    )
    base = res.get((0, False, False))
    print(
        "| mode | s / 100 groups | throughput vs sync | staleness mean (max) | loop wait s/step | producer idle "
        "s/step | rollout s | train s | sync s | mean length | at limit |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k, r in res.items():
        ratio = f"{base['s_per_100'] / r['s_per_100']:.2f}×" if base else "–"
        wait, idle = ("= rollout", "–") if k[0] == 0 else (f"{r['wait']:.3f}", f"{r['idle']:.3f}")
        print(
            f"| {mode_name(k)} | {r['s_per_100']:.1f} | {ratio} | {r['staleness']:.2f} ({r['staleness_max']:g}) | "
            f"{wait} | {idle} | {r['rollout']:.3f} | {r['train']:.3f} | {r['sync']:.3f} | "
            f"{r['length']:.1f} | {r['clipped']:.0%} |"
        )
    if a.rounds > 1:
        print(
            "s / 100 groups by round: "
            + "; ".join(
                f"{mode_name(k)} " + ", ".join(f"{x['s_per_100']:.1f}" for x in rs) for k, rs in per_round.items()
            )
        )
    print("(rollout/train/sync: the loop's timing/* per step, train includes timing/logps)")


if __name__ == "__main__":
    main()
