"""Peak memory of the training forward + backward for a big vocabulary: plain logps against chunked logps.

A random Qwen3 with a 150k vocabulary and a small body (hidden 64, one layer), B completions of C tokens after a
P-token prompt. Each mode runs in its own fresh process: the forward through ``completion_logps`` (the trainer's
path, trainers/packing.py) and the backward of Σ logps. Reported: the peak memory above what the process held
before the forward (CUDA: ``max_memory_allocated``; CPU: peak resident memory, ``ru_maxrss``), and the seconds
of forward + backward. ``--logps_chunk_size 0`` is the plain path; the script runs it and the given chunk sizes.

    python bench/bench_logps_memory.py --batch 8 --completion 256 --chunk_sizes 1024 256
    python bench/bench_logps_memory.py --time_tiny 50     # step-time side: plain vs chunked on the tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(args) -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from grpokit.trainers.packing import ForwardOptions, completion_logps

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(cfg).to(device=device, dtype=getattr(torch, args.dtype)).train()
    length = args.prompt + args.completion
    inputs = {
        "input_ids": torch.randint(0, args.vocab, (args.batch, length), device=device),
        "attention_mask": torch.ones(args.batch, length, dtype=torch.long, device=device),
        "position_ids": torch.arange(length, device=device).expand(args.batch, -1),
    }
    opts = ForwardOptions(temperature=1.0, chunk_size=args.chunk_size, padding_free=False, share_prompts=False)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        before = _rss_mb()
    t0 = time.perf_counter()
    logps, _ = completion_logps(model, inputs, args.completion, opts)
    logps.sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = _rss_mb()
    return {
        "chunk_size": args.chunk_size,
        "device": device,
        "peak_mb_above_start": round(peak - before),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def time_tiny(repeats: int) -> None:
    """Forward + backward of the logps on the tests' tiny model (vocab ~500, the bench_step shape: 16 rows, a
    44-token prompt, 16 completion tokens), plain and chunked alternating in one process: the median of each."""
    import statistics
    import tempfile
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from grpokit.testing import build_tiny_model
    from grpokit.trainers.packing import ForwardOptions, completion_logps

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "tiny", hidden_size=128, num_layers=2)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    g = torch.Generator().manual_seed(0)
    inputs = {
        "input_ids": torch.randint(0, model.config.vocab_size, (16, 60), generator=g),
        "attention_mask": torch.ones(16, 60, dtype=torch.long),
        "position_ids": torch.arange(60).expand(16, -1),
    }
    times: dict[int, list[float]] = {0: [], 1024: []}
    for _ in range(repeats):
        for size in times:
            opts = ForwardOptions(temperature=1.0, chunk_size=size, padding_free=False, share_prompts=False)
            t0 = time.perf_counter()
            completion_logps(model, inputs, 16, opts)[0].sum().backward()
            times[size].append(time.perf_counter() - t0)
    plain, chunked = (statistics.median(times[k]) for k in (0, 1024))
    print(
        f"tiny model, forward+backward of the logps, median of {repeats}: plain {plain * 1e3:.1f} ms, "
        f"chunked {chunked * 1e3:.1f} ms, ratio chunked/plain {chunked / plain:.2f}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=150_000)
    p.add_argument("--batch", type=int, default=8, help="completions in the micro-batch (B)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens (P)")
    p.add_argument("--completion", type=int, default=256, help="completion tokens (C)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--chunk_sizes", type=int, nargs="+", default=[1024], help="chunked modes to compare with 0")
    p.add_argument(
        "--time_tiny",
        type=int,
        metavar="N",
        help="instead: time plain vs chunked on the tiny model, N alternating repeats",
    )
    p.add_argument("--chunk_size", type=int, help=argparse.SUPPRESS)  # one mode, in a child process
    args = p.parse_args()
    if args.time_tiny:
        time_tiny(args.time_tiny)
        return
    if args.chunk_size is not None:
        print(json.dumps(measure(args)))
        return
    logits_mb = args.batch * args.completion * args.vocab * 4 / 2**20
    print(
        f"V={args.vocab} B={args.batch} P={args.prompt} C={args.completion} {args.dtype}: one float32 copy of "
        f"the completion logits is {logits_mb:.0f} MB"
    )
    common = [f"--{k}={getattr(args, k)}" for k in ("vocab", "batch", "prompt", "completion", "dtype")]
    # CPU: glibc hands every freed block over 1 MB back at once, so the peak resident memory follows the tensors
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    for size in [0, *args.chunk_sizes]:
        out = subprocess.run(
            [sys.executable, __file__, *common, f"--chunk_size={size}"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        row = json.loads(out.stdout.strip().splitlines()[-1])
        mode = "plain" if size == 0 else f"chunked ({size} rows)"
        print(
            f"{mode:>22}: peak {row['peak_mb_above_start']:>6} MB above start, {row['seconds']:.2f} s "
            f"forward+backward ({row['device']})"
        )


if __name__ == "__main__":
    main()
