"""What the sampler's kept set costs in the training logps (algorithms/kept_set.py): one forward + backward of
Σ logps through the chunked output head, with the full vocabulary (``--logps_support full``, or nothing
truncated) and over the kept set of top-k and of top-p. The modes alternate in one process, so a slow spell of a
shared machine hits all of them; reported: the median seconds per mode and the ratio to the full vocabulary.

    python bench/bench_kept_set.py --vocab 32000 --rows 512 --repeats 5 --logit_std 6
    python bench/bench_kept_set.py --vocab 32000 --rows 512 --repeats 5 --logit_std 1.6
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from grpokit.algorithms import SamplerSupport, chunked_lm_head_logps

MODES = {
    "full": None,
    "top_k 20": SamplerSupport(top_k=20),
    "top_p 0.8": SamplerSupport(top_p=0.8),
    "top_k 20 + top_p 0.8": SamplerSupport(top_k=20, top_p=0.8),
}


def once(hidden, weight, targets, support, chunk: int) -> float:
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    t0 = time.perf_counter()
    logps, _ = chunked_lm_head_logps(h, w, None, targets, temperature=0.9, chunk_size=chunk, support=support)
    logps.sum().backward()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rows", type=int, default=1024, help="completion tokens of the micro-batch (B·C)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--chunk", type=int, default=1024, help="--logps_chunk_size")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--logit_std",
        type=float,
        default=6.0,
        help="spread of the random logits: small is flat (top-p's cut lies beyond the 512 largest "
        "logits and whole rows are sorted), large is peaked like a trained model's",
    )
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(a.rows, a.hidden, generator=gen)
    weight = torch.randn(a.vocab, a.hidden, generator=gen) * (a.logit_std * 0.9 / a.hidden**0.5)  # z / T
    targets = torch.randint(0, a.vocab, (a.rows,), generator=gen)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for m, s in MODES.items():  # warm-up
        once(hidden, weight, targets, s, a.chunk)
    for _ in range(a.repeats):
        for m, s in MODES.items():
            times[m].append(once(hidden, weight, targets, s, a.chunk))
    full = statistics.median(times["full"])
    print(
        f"V {a.vocab}, {a.rows} rows, hidden {a.hidden}, logit std {a.logit_std}, chunk {a.chunk}, "
        f"{a.threads} thread(s), median of {a.repeats}"
    )
    for m, ts in times.items():
        med = statistics.median(ts)
        print(f"  {m:22s} {med:.3f} s  ({med / full:.2f}× full)")


if __name__ == "__main__":
    main()
