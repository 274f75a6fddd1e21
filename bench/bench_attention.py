"""Attention forward + backward at one shape: torch's scaled_dot_product_attention against eager attention.

Eager is the arithmetic of transformers' eager attention (``--attn_impl eager``): q·kᵀ scaled, the causal
mask, softmax in float32, ·v. The shape defaults to one micro-batch of the demo (SmolLM2-135M: 9 heads of 64;
8 rows of about 60 tokens). Each variant runs warm-up calls, then the mean of ``--repeats`` calls; the variants
alternate in one process.

    python bench/bench_attention.py --dtype bfloat16
    python bench/bench_attention.py --dtype float32 --tokens 512
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--tokens", type=int, default=60)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    shape = (a.rows, a.heads, a.tokens, a.head_dim)
    q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, dtype=dtype)
    causal = torch.ones(a.tokens, a.tokens, dtype=torch.bool).tril()

    def sdpa() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    def eager() -> None:
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(a.head_dim)
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")).float(), dim=-1).to(dtype)
        (probs @ v).backward(grad)

    variants = {"scaled_dot_product_attention (is_causal)": sdpa, "eager (float32 softmax)": eager}
    totals = dict.fromkeys(variants, 0.0)
    for fn in variants.values():
        for _ in range(3):
            fn()
    for _ in range(a.repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            totals[name] += time.perf_counter() - t0
    print(f"forward + backward, {list(shape)} {a.dtype}, {torch.get_num_threads()} threads, mean of {a.repeats}")
    for name, total in totals.items():
        print(f"  {name:42s} {1e3 * total / a.repeats:7.2f} ms")


if __name__ == "__main__":
    main()
