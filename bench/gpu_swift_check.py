"""ms-swift's rollout protocol on a CUDA machine, both ways (``bench/gpu_check.sh`` with ``SWIFT_CHECK=1``; needs
ms-swift 4.6 and a CUDA build of vLLM in this Python). On CPU machines tests/swift_env covers the same protocol with
gloo in place of NCCL; this checks the GPU paths those tests cannot reach, on models built offline
(``bench/gpu_check_plugin.py model DIR --tiny``, and a second one with other weights):

1. ms-swift's own ``VLLMClient`` against ``grpokit rollout --engine vllm``: health, engine type, caches, and greedy
   answers equal to grpokit's own client's on the same server;
2. grpokit's trainer client against a real ``swift rollout`` (vLLM generating): the protocol detected, engine type,
   answers restored;
3. with two GPUs visible, the weight push over NCCL both ways, the trainer's model on GPU 1 (NCCL does not take two
   ranks of one group on one device, so one GPU stops after 1 and 2): after ms-swift's client pushes model B into a
   grpokit server started from model A, its greedy answers are those of a grpokit server started from B; after
   grpokit's client pushes B into a ``swift rollout`` started from A, its answers are those of one started from B.

Usage: ``python bench/gpu_swift_check.py WORKDIR``; exit 0 when every check holds, 1 naming the first that fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from grpokit.config.parse import parse_train_args
from grpokit.engines.swift_client import SwiftRolloutClient, connect
from grpokit.modeling import load_causal_lm
from grpokit.protocol import RequestConfig, RolloutInferRequest
from grpokit.testing import free_port

QUESTIONS = ["What is 3 + 7?", "What is 12 + 7?"]
GREEDY = RequestConfig(max_tokens=16, temperature=0, logprobs=True)
VLLM_SMALL = ["--vllm_gpu_memory_utilization", "0.2", "--vllm_max_model_len", "512"]


@contextlib.contextmanager
def server(argv: list[str], log: Path, timeout_s: float = 300):
    """A rollout server process (``grpokit rollout`` or ``swift rollout``) on a free port until the block ends."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([*argv, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})  # fmt: skip
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                sys.exit(f"gpu_swift_check: {argv[0]} {argv[1]} exited:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                sys.exit(f"gpu_swift_check: {argv[1]} not up after {timeout_s:g}s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield port
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        if proc.poll() is None:
            proc.kill()


def grpokit_rollout(model: Path, log: Path):
    return server([sys.executable, "-m", "grpokit", "rollout", "--model", str(model), "--engine", "vllm",
                   *VLLM_SMALL], log)  # fmt: skip


def swift_rollout(model: Path, log: Path):
    return server(["swift", "rollout", "--model", str(model), "--host", "127.0.0.1", *VLLM_SMALL], log)


def check(ok: bool, what: str) -> None:
    print(f"gpu_swift_check: {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        sys.exit(1)


def ours(port: int) -> list[list[int]]:
    """Greedy token ids of QUESTIONS through grpokit's client, whichever protocol the server speaks."""
    client = connect(_args(port))
    try:
        requests = [RolloutInferRequest(messages=[{"role": "user", "content": q}]) for q in QUESTIONS]
        return [o.response.choices[0].token_ids for o in client.infer_trajectories(requests, GREEDY)]
    finally:
        client.close()


def _args(port: int):
    return parse_train_args(
        [
            "--dataset",
            "builtin:arithmetic",
            "--vllm_mode",
            "server",
            "--vllm_server_host",
            "127.0.0.1",
            "--vllm_server_port",
            str(port),
            "--vllm_server_timeout",
            "300",
        ]
    ).rollout


def theirs(port: int, push_from: torch.nn.Module | None = None) -> list[list[int]]:
    """Greedy token ids through ms-swift's VLLMClient, after pushing ``push_from``'s weights over NCCL if given."""
    from swift.infer_engine.protocol import RequestConfig as SwiftConfig
    from swift.infer_engine.protocol import RolloutInferRequest as SwiftRequest
    from swift.rlhf_trainers.utils import FlattenedTensorBucket
    from swift.rlhf_trainers.vllm_client import VLLMClient

    client = VLLMClient(base_urls=[f"http://127.0.0.1:{port}"], group_ports=free_port(), connection_timeout=120)
    check(client.get_engine_type()["engine_type"] in ("LLMEngine", "AsyncLLMEngine"), "ms-swift client: engine type")
    client.reset_prefix_cache()
    client.reset_mm_cache()
    client.reset_encoder_cache()
    if push_from is not None:
        client.init_communicator(device=1)
        named = [(n, p.detach()) for n, p in push_from.named_parameters()]
        bucket = FlattenedTensorBucket(named_tensors=named)
        client.update_flattened_params(bucket.get_metadata(), bucket.get_flattened_tensor())
        client.process_weights_after_loading()
        client.reset_prefix_cache()
    requests = [SwiftRequest(messages=[{"role": "user", "content": q}], uuid=f"u{i}") for i, q in enumerate(QUESTIONS)]
    outputs = client.infer(requests, SwiftConfig(max_tokens=16, temperature=0.0, logprobs=True, return_details=True))
    check([o.response.id for o in outputs] == ["u0", "u1"], "ms-swift client: answers restored, id = uuid")
    if push_from is not None:
        client.close_communicator()
    return [o.response.choices[0].token_ids for o in outputs]


def main(work: Path) -> None:
    a, b = work / "model_a", work / "model_b"
    subprocess.run([sys.executable, "bench/gpu_check_plugin.py", "model", str(a), "--tiny"], check=True)
    model_b = load_causal_lm(str(a), torch.float32)
    with torch.no_grad():
        for p in model_b.parameters():
            p.add_(0.5 * torch.randn_like(p))
    model_b.save_pretrained(b)
    for f in a.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, b / f.name)
    two_gpus = torch.cuda.device_count() >= 2
    model_b = model_b.to("cuda:1") if two_gpus else model_b

    with grpokit_rollout(a, work / "grpokit_a.log") as port:  # 1
        check(theirs(port) == ours(port), "ms-swift client vs grpokit rollout: greedy answers equal grpokit's client's")
        if two_gpus:
            pushed = theirs(port, push_from=model_b)
            with grpokit_rollout(b, work / "grpokit_b.log") as port_b:
                check(pushed == ours(port_b), "ms-swift client pushed B over NCCL: answers are a B server's")
    with swift_rollout(a, work / "swift_a.log") as port:  # 2
        client = connect(_args(port))
        check(isinstance(client, SwiftRolloutClient), "grpokit client: detects swift rollout")
        check(client.engine_info()["protocol"] == "ms-swift", "grpokit client: engine type")
        client.close()
        answers = ours(port)
        check(all(answers), "grpokit client vs swift rollout: answers restored")
        if two_gpus:
            client = connect(_args(port))
            client.sync_weights(model_b)
            client.close()
            pushed = ours(port)
    if two_gpus:
        with swift_rollout(b, work / "swift_b.log") as port_b:
            check(pushed == ours(port_b), "grpokit client pushed B over NCCL into swift rollout: answers are a B one's")
    else:
        print("gpu_swift_check: the NCCL weight pushes need two GPUs (one group cannot hold two ranks of one device)")
    print("gpu_swift_check: passed")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python bench/gpu_swift_check.py WORKDIR")
    main(Path(sys.argv[1]))
