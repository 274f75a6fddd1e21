"""Seconds per AdamW step: grpokit's ``--optimizer adamw`` (torch's fused kernel) against the per-tensor loop.

Every trainable parameter gets a random gradient; both optimizers then step R times, interleaved, on their own
copies of the weights. Reported: the median per variant and the ratio. With ``--lora`` only LoRA adapters
(r16, all linear layers) are trainable, as in the demo.

    python bench/bench_optimizer.py --model tiny --repeats 50
    python bench/bench_optimizer.py --model smollm --lora --repeats 10
    python bench/bench_optimizer.py --model smollm --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny, smollm, or a model folder")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters only")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from bench_step import resolve_model

    from grpokit.modeling import load_causal_lm
    from grpokit.trainers.optimizers import build_adamw

    model = load_causal_lm(resolve_model(a.model, Path(tempfile.mkdtemp())), torch.float32)
    if a.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    args = SimpleNamespace(learning_rate=1e-5, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999)
    variants = {}
    for name in ("fused (grpokit adamw)", "per-tensor loop"):
        params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters() if p.requires_grad]
        for q in params:
            q.grad = torch.randn_like(q)
        if name.startswith("fused"):
            opt = build_adamw(params, args)
            assert opt.param_groups[0]["fused"], "the fused kernel was refused on this machine"
        else:
            opt = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=0.0)
        opt.step()  # state allocation is not part of a step
        variants[name] = opt
    del model
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(a.repeats):
        for name, opt in variants.items():
            t = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t)
    n = sum(q.numel() for q in next(iter(variants.values())).param_groups[0]["params"])
    print(
        f"model {a.model}{' LoRA' if a.lora else ''}: {n / 1e6:.2f}M trainable parameters, "
        f"{a.repeats} steps each, {a.threads} threads"
    )
    base = statistics.median(times["per-tensor loop"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:22s} {med * 1e3:9.2f} ms/step  {med / base:5.2f}x")


if __name__ == "__main__":
    main()
