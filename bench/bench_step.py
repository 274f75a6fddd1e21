"""Wall time per optimizer step and peak memory: grpokit, and TRL's GRPOTrainer at the same settings.

Each framework runs in its own fresh process, one after the other, in one invocation, on the same model,
prompts, reward, batch, num_generations, max_completion_length, loss and step count. With ``--rounds R`` the
frameworks alternate R times (grpokit, trl, grpokit, trl, ...), so that slow spells of a noisy machine hit both.
Reported: median seconds per step over all rounds (the first step of each run is warm-up and excluded),
grpokit's split into rollout / reward / logps / train / other, peak resident memory, the ratio grpokit / TRL
and its spread over rounds, the CPU seconds per step, and for every framework where its step's time goes
(prefill, decode, reward, old/ref logps, forward, backward, optimizer, sync, bookkeeping: bench/step_profile.py,
which times TRL by wrapping its methods from outside).

    python bench/bench_step.py --model tiny --steps 12 --rounds 3
    python bench/bench_step.py --model smollm --steps 5 --lora --lr 2e-4

``--baseline REF`` adds grpokit as of git revision REF (checked out into a temporary worktree and imported
through PYTHONPATH) as one more framework, ``grpokit@REF``: a before/after comparison in one invocation.

    python bench/bench_step.py --frameworks grpokit --baseline 4bd70af --model tiny --steps 10 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_profile  # noqa: E402  (bench/ is no package)

PROMPTS = "builtin:arithmetic"
TRL_FOLDER = Path.home() / ".cache" / "grpokit" / "trl-1.16.0"  # where the dev set-up installs TRL (--no-deps)
PROFILE = step_profile.StepProfile()
CPU_STAMPS: list[float] = []  # the process's CPU seconds at the same moments as the step stamps


def resolve_model(name: str, workdir: Path) -> str:
    if name == "tiny":
        from grpokit.testing import build_tiny_model

        return str(build_tiny_model(workdir / "tiny", hidden_size=128, num_layers=2))
    if name == "smollm":
        from grpokit.pipeline.default_model import ensure_default_model

        return str(ensure_default_model())
    return name


def run_grpokit(a: argparse.Namespace, out: Path) -> dict:
    from grpokit.config.parse import parse_train_args
    from grpokit.pipeline.train import run_train
    from grpokit.trainers.callbacks import TrainerCallback, callbacks_map

    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_train_begin(self, trainer):
            stamps.append(time.perf_counter())
            CPU_STAMPS.append(time.process_time())

        def on_step_end(self, trainer):
            stamps.append(time.perf_counter())
            CPU_STAMPS.append(time.process_time())
            PROFILE.close_step(stamps[-1] - stamps[-2], step_profile.grpokit_phases)

    callbacks_map["bench_stamp"] = Stamp
    args = [
        "--model",
        a.model_path,
        "--dataset",
        PROMPTS,
        "--reward_funcs",
        "accuracy",
        "--num_generations",
        str(a.num_generations),
        "--per_device_train_batch_size",
        str(a.batch),
        "--max_completion_length",
        str(a.max_completion_length),
        "--max_steps",
        str(a.steps),
        "--learning_rate",
        str(a.lr),
        "--beta",
        "0",
        "--loss_type",
        "grpo",
        "--torch_dtype",
        "float32",
        "--output_dir",
        str(out / "grpokit"),
        "--overwrite_output_dir",
        "true",
        "--save_steps",
        "100000",
        "--save_final_model",
        "false",
        "--plots",
        "false",
        "--disable_tqdm",
        "true",
        "--callbacks",
        "bench_stamp",
        "--seed",
        "0",
    ]
    if a.lora:
        args += ["--tuner_type", "lora", "--lora_rank", "16", "--lora_alpha", "32", "--lora_dropout", "0"]
    else:  # grpokit's default is LoRA (ms-swift's); TRL trains every weight unless given a peft config
        args += ["--tuner_type", "full"]
    if a.device == "cpu":
        args += ["--use_cpu", "true"]
    if a.top_p != 1.0 or a.top_k > 0:  # given only when set: a --baseline revision may predate an option
        args += ["--top_p", str(a.top_p), "--top_k", str(a.top_k)]
    run_train(parse_train_args(args))
    rows = [json.loads(x) for x in (out / "grpokit" / "logging.jsonl").read_text().splitlines()]
    steps = [b - a_ for a_, b in zip(stamps, stamps[1:])]
    keys = [k for k in rows[0] if k.startswith("timing/")]
    split = []  # one per step, in step order
    for r, t in zip(rows, steps):
        phases = {k.split("/")[1]: r[k] for k in keys}
        split.append({**phases, "other": t - sum(phases.values())})  # bookkeeping outside the timed phases
    return {"step_s": steps, "split": split}


def run_trl(a: argparse.Namespace, out: Path) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpokit.data.loading import load_dataset_spec, normalize_rows
    from grpokit.rewards.math_rewards import MathAccuracy

    rows = normalize_rows(load_dataset_spec(PROMPTS, seed=0), None)
    ds = Dataset.from_list([{"prompt": r["messages"], "solution": r["solution"]} for r in rows])
    acc = MathAccuracy()

    def accuracy(completions, solution, **kwargs):
        return acc([c[-1]["content"] for c in completions], solution=solution)

    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            stamps.append(time.perf_counter())
            CPU_STAMPS.append(time.process_time())

        def on_step_end(self, *args, **kwargs):
            stamps.append(time.perf_counter())
            CPU_STAMPS.append(time.process_time())
            PROFILE.close_step(stamps[-1] - stamps[-2], step_profile.trl_phases)

    cfg = GRPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=a.batch,
        num_generations=a.num_generations,
        max_completion_length=a.max_completion_length,
        max_steps=a.steps,
        learning_rate=a.lr,
        beta=0.0,
        loss_type="grpo",
        use_cpu=a.device == "cpu",
        bf16=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        temperature=1.0,
        gradient_accumulation_steps=1,
        use_vllm=False,
        disable_tqdm=True,
        top_p=a.top_p,
        **({"top_k": a.top_k} if a.top_k > 0 else {}),
    )
    peft = None
    if a.lora:
        from peft import LoraConfig

        peft = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=a.model_path, reward_funcs=[accuracy], args=cfg, train_dataset=ds, peft_config=peft, callbacks=[Stamp()]
    )
    trainer.train()
    return {"step_s": [b - a_ for a_, b in zip(stamps, stamps[1:])]}


def _timed(owner, name: str, calls: list[float]) -> None:
    method = getattr(owner, name)

    def wrapper(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            calls.append(time.perf_counter() - t0)

    setattr(owner, name, wrapper)


def time_generate() -> tuple[list[float], list[float]]:
    """Record the seconds of every decode loop: HF ``generate`` (TRL here, and grpokit with --fast_decode false)
    and grpokit's own loop (``FastDecoder.generate``); and of every call of grpokit's transformers engine
    (``TransformersEngine.infer``: messages in, completions out, the decode loop included)."""
    from transformers.generation.utils import GenerationMixin

    from grpokit.engines.fast_decode import FastDecoder
    from grpokit.engines.transformers_engine import TransformersEngine

    decode: list[float] = []
    engine: list[float] = []
    _timed(GenerationMixin, "generate", decode)
    _timed(FastDecoder, "generate", decode)
    _timed(TransformersEngine, "infer", engine)
    return decode, engine


def child(a: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(a.threads)
    out = Path(a.workdir)
    generate_s, engine_s = time_generate()
    grpokit = a.framework.startswith("grpokit")
    (step_profile.profile_grpokit if grpokit else step_profile.profile_trl)(PROFILE)
    if a.device == "cuda":
        PROFILE.sync = torch.cuda.synchronize
    result = (run_grpokit if grpokit else run_trl)(a, out)
    result["generate_s"] = generate_s
    result["engine_s"] = engine_s
    result["profile"] = PROFILE.steps
    result["cpu_s"] = [b - a_ for a_, b in zip(CPU_STAMPS, CPU_STAMPS[1:])]
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (out / f"{a.framework}.json").write_text(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny, smollm, or a model folder")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--batch", type=int, default=16, help="completions per step")
    p.add_argument("--max_completion_length", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling (1: off)")
    p.add_argument("--top_k", type=int, default=-1, help="top-k sampling (-1: off)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: both trainers on the GPU")
    p.add_argument("--trl_path", default=str(TRL_FOLDER), help="a folder holding trl, when it is not installed")
    p.add_argument("--frameworks", nargs="+", default=["grpokit", "trl"])
    p.add_argument("--rounds", type=int, default=1, help="alternate the frameworks this many times")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--baseline", default=None, help="also run grpokit as of this git revision")
    p.add_argument("--framework", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--model_path", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.framework:
        return child(a)
    work = Path(tempfile.mkdtemp(prefix="grpokit-bench-"))
    a.model_path = resolve_model(a.model, work)
    frameworks = list(a.frameworks)
    env = {**os.environ, "GRPOKIT_LOG_LEVEL": "WARNING"}
    envs = {fw: env for fw in frameworks}
    if "trl" in frameworks:
        import importlib.util

        if importlib.util.find_spec("trl") is not None:
            pass
        elif (Path(a.trl_path) / "trl").is_dir():  # TRL installed without its dependencies, beside the venv
            envs["trl"] = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [env.get("PYTHONPATH"), a.trl_path]))}
        else:
            print("trl is not installed: skipping the side-by-side run (pip install trl, or --trl_path)")
            frameworks.remove("trl")
    if a.baseline:
        frameworks.append(f"grpokit@{a.baseline}")
        envs[frameworks[-1]] = {**env, "PYTHONPATH": checkout(a.baseline, work)}
    results: dict[str, list[dict]] = {fw: [] for fw in frameworks}
    for _ in range(a.rounds):
        for fw in frameworks:
            cmd = [
                sys.executable,
                __file__,
                "--framework",
                fw,
                "--workdir",
                str(work),
                "--model_path",
                a.model_path,
                *sys.argv[1:],
            ]
            subprocess.run(cmd, check=True, env=envs[fw])
            results[fw].append(json.loads((work / f"{fw}.json").read_text()))
    report(a, results)


def checkout(rev: str, work: Path) -> str:
    """The files of this repository at ``rev`` (``git archive``: nothing is registered in the repository, so a
    bench leaves no worktree behind), for the ``--baseline`` run; returns their folder."""
    path = work / "baseline"
    path.mkdir()
    repo = Path(__file__).resolve().parent.parent
    tar = subprocess.run(["git", "-C", str(repo), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(path)], input=tar, check=True)
    return str(path)


def report(a: argparse.Namespace, results: dict[str, list[dict]]) -> None:
    print(
        f"\nmodel {a.model}, {a.batch} completions/step ({a.batch // a.num_generations} prompts × "
        f"{a.num_generations}), max_completion_length {a.max_completion_length}, {a.steps} steps × "
        f"{a.rounds} round(s), {'LoRA r16' if a.lora else 'full'}, {a.threads} threads, {a.device}"
    )
    med, per_round, rss = {}, {}, {}
    for fw, runs in results.items():
        steps = [s for r in runs for s in (r["step_s"][1:] or r["step_s"])]
        med[fw] = statistics.median(steps)
        per_round[fw] = [statistics.median(r["step_s"][1:] or r["step_s"]) for r in runs]
        rss[fw] = max(r["peak_rss_mb"] for r in runs)
        gen = [g for r in runs for g in r.get("generate_s", [])[1:]]
        gen_text = f"   in the decode loop {statistics.median(gen):.3f} s/call" if gen else ""
        print(f"  {fw:8s} median {med[fw]:.3f} s/step   peak RSS {rss[fw]:.0f} MB{gen_text}")
        splits = [s for r in runs for s in r.get("split", [])[1:]]
        if splits:
            split = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
            parts = ", ".join(f"{k} {v:.3f}" for k, v in split.items())
            print(f"           split (medians per step): {parts} ({100 * split['other'] / med[fw]:.1f}% other)")
            # pipeline overhead: the step outside the decode loop and the train phase (forward, backward,
            # optimizer); one rollout per step at these settings, so steps and decode calls pair up
            outside = [
                step - g - s["train"]
                for r in runs
                for step, g, s in zip(r["step_s"][1:], r["generate_s"][1:], r["split"][1:])
            ]
            print(
                f"           outside the decode loop and the train phase: {statistics.median(outside):.4f} s/step "
                f"({100 * statistics.median(outside) / med[fw]:.1f}% of the step)"
            )
            # the same, with the engine's request handling (prompt encoding, building the sampling weights,
            # decoding the text) counted as generation: the trainer's own pipeline around the engine
            around = [
                step - e - s["train"]
                for r in runs
                for step, e, s in zip(r["step_s"][1:], r["engine_s"][1:], r["split"][1:])
            ]
            print(
                f"           outside the engine call and the train phase: {statistics.median(around):.4f} s/step "
                f"({100 * statistics.median(around) / med[fw]:.1f}% of the step)"
            )
    splits = {fw: [s for r in runs for s in r.get("profile", [])[1:]] for fw, runs in results.items()}
    print("\nwhere a step's time goes (median seconds per step, first step of each run dropped):\n")
    print(step_profile.format_table(splits, med))
    base = f"grpokit@{a.baseline}"
    if "grpokit" in med and base in med:
        ratios = [g / b for g, b in zip(per_round["grpokit"], per_round[base])]
        spread = f" (rounds: {', '.join(f'{r:.3f}' for r in ratios)})" if len(ratios) > 1 else ""
        print(
            f"  ratio grpokit/{base}: time {med['grpokit'] / med[base]:.3f}×{spread}, memory "
            f"{rss['grpokit'] / rss[base]:.2f}×"
        )
    cpu = {fw: [s for r in runs for s in r.get("cpu_s", [])[1:]] for fw, runs in results.items()}
    if all(cpu.values()):  # CPU seconds: less moved than wall time by other jobs on a shared machine
        print(
            "  CPU seconds per step (median): " + ", ".join(f"{fw} {statistics.median(v):.3f}" for fw, v in cpu.items())
        )
        if "grpokit" in cpu and "trl" in cpu:
            ratio = statistics.median(cpu["grpokit"]) / statistics.median(cpu["trl"])
            print(f"  ratio grpokit/trl in CPU seconds: {ratio:.2f}×")
    if "grpokit" in med and "trl" in med:
        ratios = [g / t for g, t in zip(per_round["grpokit"], per_round["trl"])]
        spread = f" (rounds: {', '.join(f'{r:.2f}' for r in ratios)})" if len(ratios) > 1 else ""
        print(
            f"  ratio grpokit/trl: time {med['grpokit'] / med['trl']:.2f}×{spread}, memory "
            f"{rss['grpokit'] / rss['trl']:.2f}×"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results, "median_s": med}, indent=2))


if __name__ == "__main__":
    main()
