"""Server mode with and without --async_generate, side by side in one run: median wall time per step.

Starts one `grpokit rollout` server (subprocess, 127.0.0.1, free port) and trains the same settings twice against
it, first synchronously, then with the next window's rollout overlapping training. Reports the median seconds
per optimizer step of each (first step excluded) and the logged async metrics.

    python bench/bench_async.py --model tiny --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


STAMP_PLUGIN = """
import time
from grpokit.trainers.callbacks import TrainerCallback, callbacks_map

class StepStamps(TrainerCallback):
    def on_step_end(self, trainer):
        with open(trainer.output_dir / "step_stamps.txt", "a") as f:
            f.write(f"{time.perf_counter()}\\n")

callbacks_map["step_stamps"] = StepStamps
"""


def train(a: argparse.Namespace, model: str, port: int, out: Path, async_generate: bool) -> list[float]:
    """Seconds per optimizer step (from a callback's timestamps), the first step excluded."""
    cmd = [sys.executable, "-m", "grpokit", "train", "--model", model, "--dataset", "builtin:arithmetic",
           "--reward_funcs", "accuracy", "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1",
           "--vllm_server_port", str(port), "--max_steps", str(a.steps), "--num_generations", "8",
           "--per_device_train_batch_size", str(a.batch), "--max_completion_length", str(a.max_completion_length),
           "--output_dir", str(out), "--save_final_model", "false", "--save_steps", "100000", "--plots", "false",
           "--beta", "0", "--torch_dtype", "float32", "--async_generate", str(async_generate).lower(),
           "--external_plugins", str(out.parent / "bench_stamps.py"), "--callbacks", "step_stamps"]
    if a.lora:
        cmd += ["--tuner_type", "lora", "--lora_rank", "16", "--lora_alpha", "32", "--learning_rate", "2e-4"]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.trainer_threads)}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    stamps = [float(x) for x in (out / "step_stamps.txt").read_text().split()]
    rows = [json.loads(x) for x in (out / "logging.jsonl").read_text().splitlines()]
    return [b - a_ for a_, b in zip(stamps, stamps[1:])], rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny, smollm, or a model folder")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max_completion_length", type=int, default=16)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--trainer_threads", type=int, default=1)
    p.add_argument("--server_threads", type=int, default=1)
    a = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_step import resolve_model

    work = Path(tempfile.mkdtemp(prefix="grpokit-async-"))
    model = resolve_model(a.model, work)
    (work / "bench_stamps.py").write_text(STAMP_PLUGIN)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(a.server_threads)}
    server = subprocess.Popen([sys.executable, "-m", "grpokit", "rollout", "--model", model, "--port", str(port),
                               "--torch_dtype", "float32"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health/", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("the rollout server did not start")
            time.sleep(1)
        results = {mode: train(a, model, port, work / f"async_{mode}", mode) for mode in (False, True)}
    finally:
        server.kill()
        server.wait()
    print(f"model {a.model}, {a.batch} completions/step, {a.steps} steps, trainer and server on "
          f"{a.trainer_threads}+{a.server_threads} threads")
    medians = {}
    for mode, (steps, rows) in results.items():
        medians[mode] = statistics.median(steps)
        line = f"  async_generate {str(mode).lower():5s}: median {medians[mode]:.2f} s/step"
        if mode:
            line += (f", rollout waited {statistics.median(r['async/wait_s'] for r in rows[1:]):.2f} s/step, "
                     f"hidden {statistics.median(r['async/time_saved_s'] for r in rows[1:]):.2f} s/step")
        print(line)
    print(f"  ratio async/sync: {medians[True] / medians[False]:.2f}×")


if __name__ == "__main__":
    main()
