"""Where one optimizer step's time goes, in grpokit and in TRL, measured the same way from outside both.

Both trainers run unmodified; this module wraps their methods in the bench's own process (class attributes
replaced by timing wrappers) and adds up the seconds of each call per optimizer step:

- ``prefill`` / ``decode``: the decode loop (HF ``generate`` in TRL, ``FastDecoder.generate`` in grpokit), split
  at the end of the first forward over the prompts;
- ``rollout other``: the rest of the rollout: prompt rendering, tokenizing, detokenizing, request objects;
- ``reward``; ``logps``: old/ref log-probabilities computed before training (a forward of their own);
- ``forward`` / ``backward``: the training loss and its backward (``torch.autograd.backward``);
- ``optimizer``: gradient clipping, the AdamW step and zeroing the gradients;
- ``sync``: copying the trained weights to the engine (grpokit; TRL generates with the training model itself);
- ``bookkeeping``: the rest of the step (advantages, tensors, logging, callbacks).
"""

from __future__ import annotations

import time
from collections import defaultdict

PHASES = (
    "prefill",
    "decode",
    "rollout other",
    "reward",
    "logps",
    "forward",
    "backward",
    "optimizer",
    "sync",
    "bookkeeping",
)


class StepProfile:
    """Seconds per timer name, added up until ``close_step`` turns them into one step's phases."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.depth: dict[str, int] = defaultdict(int)
        self.sync = None  # on a GPU: torch.cuda.synchronize, so that a phase's kernels count in its own time

    def wrap(self, owner, name: str, timer: str, method=None) -> None:
        """Replace ``owner.name`` with a wrapper adding each call's seconds to ``timer`` (outermost calls only:
        a recursive or re-entrant call is not counted twice)."""
        method = method or getattr(owner, name)
        profile = self

        def wrapper(*args, **kwargs):
            profile.depth[timer] += 1
            profile.wait()
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                profile.depth[timer] -= 1
                if profile.depth[timer] == 0:
                    profile.wait()
                    profile.current[timer] += time.perf_counter() - t0

        setattr(owner, name, wrapper)

    def wait(self) -> None:
        if self.sync is not None:
            self.sync()

    def inside(self, timer: str) -> bool:
        return self.depth[timer] > 0

    def add(self, timer: str, seconds: float) -> None:
        self.current[timer] += seconds

    def close_step(self, step_s: float, phases) -> None:
        """``phases(timers)``: the step's phases from its raw timers; bookkeeping is what they leave of ``step_s``."""
        split = phases(self.current)
        split["bookkeeping"] = step_s - sum(split.values())
        self.steps.append({k: split.get(k, 0.0) for k in PHASES})
        self.current = defaultdict(float)


def _common(profile: StepProfile) -> None:
    """Timers both trainers share: the decode loop's prefill, backward, the optimizer."""
    import torch
    from transformers.generation.utils import GenerationMixin

    from grpokit.engines.fast_decode import FastDecoder

    profile.wrap(GenerationMixin, "generate", "generate")
    profile.wrap(FastDecoder, "generate", "generate")
    profile.wrap(FastDecoder, "_prefill", "prefill")
    original = GenerationMixin.generate

    def generate(self, *args, **kwargs):  # HF generate: its first forward is the prefill
        t0: list[float] = []

        def pre(*_):
            if not t0:
                profile.wait()
                t0.append(time.perf_counter())

        def post(*_):
            if len(t0) == 1:
                profile.wait()
                t0.append(time.perf_counter())
                profile.add("prefill", t0[1] - t0[0])

        handles = [self.register_forward_pre_hook(pre), self.register_forward_hook(post)]
        try:
            return original(self, *args, **kwargs)
        finally:
            for h in handles:
                h.remove()

    GenerationMixin.generate = generate
    profile.wrap(torch.autograd, "backward", "backward")
    profile.wrap(torch.optim.AdamW, "step", "optimizer")
    profile.wrap(torch.optim.Optimizer, "zero_grad", "optimizer")
    profile.wrap(torch.nn.utils, "clip_grad_norm_", "optimizer")


def profile_grpokit(profile: StepProfile) -> None:
    from grpokit.trainers.grpo_trainer import GRPOTrainer
    from grpokit.trainers.window_producer import WindowProducer

    _common(profile)
    profile.wrap(WindowProducer, "rollout", "rollout")  # the reward included
    profile.wrap(WindowProducer, "score", "reward")
    profile.wrap(WindowProducer, "encode_rows", "logps")
    profile.wrap(GRPOTrainer, "training_step", "train")
    profile.wrap(GRPOTrainer, "_sync_weights", "sync")


def grpokit_phases(t: dict[str, float]) -> dict[str, float]:
    return {
        "prefill": t["prefill"],
        "decode": t["generate"] - t["prefill"],
        "rollout other": t["rollout"] - t["reward"] - t["generate"],
        "reward": t["reward"],
        "logps": t["logps"],  # encoding the rows, with old/ref logps where the loss needs them
        "forward": t["train"] - t["backward"],
        "backward": t["backward"],
        "optimizer": t["optimizer"],
        "sync": t["sync"],
    }


def profile_trl(profile: StepProfile) -> None:
    from trl import GRPOTrainer

    _common(profile)
    profile.wrap(GRPOTrainer, "_generate", "rollout")
    profile.wrap(GRPOTrainer, "_calculate_rewards", "reward")
    profile.wrap(GRPOTrainer, "_generate_and_score_completions", "prepare")
    profile.wrap(GRPOTrainer, "training_step", "train")
    original = GRPOTrainer._get_per_token_logps_and_entropies

    def logps(self, *args, **kwargs):  # counted before training only: the loss's own forward calls it too
        if not profile.inside("prepare"):
            return original(self, *args, **kwargs)
        profile.wait()
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            profile.wait()
            profile.add("logps", time.perf_counter() - t0)

    GRPOTrainer._get_per_token_logps_and_entropies = logps


def trl_phases(t: dict[str, float]) -> dict[str, float]:
    return {
        "prefill": t["prefill"],
        "decode": t["generate"] - t["prefill"],
        "rollout other": t["rollout"] - t["generate"],
        "reward": t["reward"],
        "logps": t["logps"],
        # training_step prepares the inputs (the whole rollout) first, then the loss and its backward
        "forward": t["train"] - t["prepare"] - t["backward"],
        "backward": t["backward"],
        "optimizer": t["optimizer"],
    }


def format_table(splits: dict[str, list[dict[str, float]]], medians: dict[str, float]) -> str:
    """A markdown table: one row per phase, one column per framework (median seconds per step, first steps
    dropped), and the step's median."""
    import statistics

    names = list(splits)
    lines = ["| phase | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for phase in PHASES:
        cells = [f"{statistics.median(s[phase] for s in splits[n]):.3f}" if splits[n] else "-" for n in names]
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    lines.append("| **step** | " + " | ".join(f"**{medians[n]:.3f}**" for n in names) + " |")
    return "\n".join(lines)
