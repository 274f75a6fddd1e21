"""The cost of --check_weight_sync in server mode: a plain weight sync against a checked one, and the probe.

Starts one `grpokit rollout` server (subprocess, transformers engine, float32, 127.0.0.1, free port) on a tiny
Qwen3-style model built here, then times, alternately, ``RolloutClient.sync_weights`` (the broadcast) and
``sync_weights_checked`` (the same broadcast with the sender's checksums, then POST /check_weights/, where the
server reads its weights back), and the logprob probe (4 greedy tokens on the server + one trainer forward).
Reports medians over ``--repeats``.

    python bench/bench_sync_check.py --hidden 256 --layers 4 --repeats 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--bucket_mb", type=int, default=16)
    a = p.parse_args()

    from grpokit.engines.client import RolloutClient
    from grpokit.engines.sync_check.probe import run_probe
    from grpokit.modeling import load_causal_lm
    from grpokit.testing import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_sync_check_"))
    model_dir = build_tiny_model(tmp / "model", hidden_size=a.hidden, num_layers=a.layers, vocab_size=a.vocab)
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_server import rollout_server

    with rollout_server(
        str(model_dir), tmp / "server.log", "--torch_dtype", "float32", "--engine", "transformers"
    ) as port:
        client = RolloutClient(base_urls=[f"http://127.0.0.1:{port}"], timeout=120, bucket_mb=a.bucket_mb)
        model = load_causal_lm(str(model_dir), torch.float32)
        n_params = sum(p.numel() for p in model.parameters())
        client.sync_weights(model)  # the group, and a first load
        plain, checked, probe = [], [], []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            client.sync_weights(model)
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            report = client.sync_weights_checked(model)
            checked.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            run_probe(client, model)
            probe.append(time.perf_counter() - t0)
        client.close()
    med = statistics.median
    print(
        f"model: {n_params / 1e6:.2f}M parameters ({a.layers} layers, hidden {a.hidden}), float32, "
        f"{report.checked} tensors checked; medians of {a.repeats}"
    )
    print(
        f"sync {med(plain):.3f}s | checked sync {med(checked):.3f}s (checksums + /check_weights/: "
        f"+{med(checked) - med(plain):.3f}s) | probe {med(probe):.3f}s | check in all "
        f"+{med(checked) - med(plain) + med(probe):.3f}s per sync"
    )


if __name__ == "__main__":
    main()
