"""Bytes and seconds per weight sync with LoRA: merged weights against the adapter alone (--vllm_enable_lora).

For each model (the tiny Qwen3-style one built here, and SmolLM2-135M-Instruct when its folder exists), a LoRA
adapter of rank ``--rank`` on every linear layer (factors drawn at random, so that the delta is not zero):

- in process: the trainer's end and the served model's end without a network: merged = every merged weight
  computed (engines/weights.py) and copied into a second model; adapter = the factors handed to the served
  model's ``AdapterVersions`` (engines/adapter_store.py), which commits a new version and rebuilds each LoRA
  layer's weight from its base;
- through the server: `grpokit rollout` (subprocess, transformers engine, 127.0.0.1) and ``RolloutClient``'s
  ``sync_weights`` over the gloo weight group, merged first, then adapter-only (its first sync, which carries the
  base, is left out of the timings).

Bytes are what goes on the wire (the served dtype). Medians over ``--repeats``.

    python bench/bench_lora_sync.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SMOLLM2 = Path.home() / ".cache/grpokit/SmolLM2-135M-Instruct"


def _policy(model_dir: Path, rank: int):
    from peft import LoraConfig, get_peft_model

    from grpokit.modeling import load_causal_lm

    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(load_causal_lm(str(model_dir), torch.float32), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.01)
    return model


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def in_process(model_dir: Path, policy, dtype: torch.dtype, repeats: int) -> dict:
    from grpokit.engines.adapter_store import AdapterVersions
    from grpokit.engines.adapters import AdapterSpec, adapter_tensors, base_tensors
    from grpokit.engines.weights import iter_sync_weights
    from grpokit.modeling import load_causal_lm

    served = load_causal_lm(str(model_dir), dtype)
    params = dict(served.named_parameters(remove_duplicate=False))
    store = AdapterVersions(params, max_rank=256)
    spec = AdapterSpec.of(policy)
    size = torch.empty(0, dtype=dtype).element_size()

    def merged() -> None:
        with torch.no_grad():
            for name, t in iter_sync_weights(policy):
                params[name].data.copy_(t)

    version = [0]

    def adapter(base: bool = False) -> None:
        named = list(base_tensors(policy)) if base else []
        named += list(adapter_tensors(policy))
        version[0] += 1
        store.begin(version[0], spec.scale, "bench", 3, [n for n, _ in named])
        store.load(named)
        store.commit()

    merged_bytes = sum(t.numel() for _, t in iter_sync_weights(policy)) * size
    adapter_bytes = sum(t.numel() for _, t in adapter_tensors(policy)) * size
    merged_s = _timed(merged, repeats)
    adapter(base=True)
    adapter_s = _timed(adapter, repeats)
    return dict(merged_bytes=merged_bytes, adapter_bytes=adapter_bytes, merged_s=merged_s, adapter_s=adapter_s)


def served(model_dir: Path, policy, dtype_name: str, repeats: int, log: Path) -> dict:
    from bench_server import rollout_server

    from grpokit.engines.adapters import AdapterSync
    from grpokit.engines.client import RolloutClient

    args = ("--torch_dtype", dtype_name, "--engine", "transformers", "--vllm_max_lora_rank", "256")
    with rollout_server(str(model_dir), log, *args) as port:
        client = RolloutClient(base_urls=[f"http://127.0.0.1:{port}"], timeout=300, bucket_mb=64)
        try:
            client.sync_weights(policy)  # the group, and a first load
            merged_s = _timed(lambda: client.sync_weights(policy), repeats)
            merged_bytes = client.last_sync_bytes
            client._adapters = AdapterSync(True, 256, "the bench's server", keep=3)
            client.sync_weights(policy)  # the base goes once
            adapter_s = _timed(lambda: client.sync_weights(policy), repeats)
            adapter_bytes = client.last_sync_bytes
        finally:
            client.close()
    return dict(merged_bytes=merged_bytes, adapter_bytes=adapter_bytes, merged_s=merged_s, adapter_s=adapter_s)


def _row(model: str, where: str, r: dict) -> str:
    mb = lambda b: f"{b / 1e6:.2f} MB"  # noqa: E731
    return (
        f"| {model} | {where} | {mb(r['merged_bytes'])} | {mb(r['adapter_bytes'])} | "
        f"{r['merged_bytes'] / r['adapter_bytes']:.0f}× | {r['merged_s']:.3f} s | {r['adapter_s']:.3f} s | "
        f"{r['merged_s'] / r['adapter_s']:.1f}× |"
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", help="the served model's dtype (the wire's)")
    p.add_argument("--skip_smollm2", action="store_true")
    a = p.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from grpokit.testing import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_lora_sync_"))
    models = [("tiny (h256, 4 layers)", build_tiny_model(tmp / "tiny", hidden_size=256, num_layers=4))]
    if SMOLLM2.is_dir() and not a.skip_smollm2:
        models.append(("SmolLM2-135M", SMOLLM2))
    dtype = getattr(torch, a.dtype)
    threads = torch.get_num_threads()
    print(f"LoRA r{a.rank} all-linear, served {a.dtype}, medians of {a.repeats}, torch threads {threads}")
    print("| model | where | merged bytes | adapter bytes | fewer bytes | merged s | adapter s | faster |")
    print("|---|---|---|---|---|---|---|---|")
    for name, model_dir in models:
        policy = _policy(model_dir, a.rank)
        print(_row(name, "in process", in_process(model_dir, policy, dtype, a.repeats)), flush=True)
        log = tmp / f"server-{len(name)}.log"
        print(_row(name, "rollout server", served(model_dir, policy, a.dtype, a.repeats, log)), flush=True)


if __name__ == "__main__":
    main()
