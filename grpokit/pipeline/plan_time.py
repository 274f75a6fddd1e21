"""A start-up line when the run's plan will be slow on the machine it runs on.

The defaults are sized for a GPU (8 completions of up to 512 tokens for each prompt); on a CPU one optimizer step
of them takes minutes, and a first run that says nothing looks hung. The estimate is the work of one optimizer
step, the model's parameters times the tokens it generates for that step (prompts × completions × tokens), over a
rate taken from two runs on a loaded 2-core AVX2 CPU: the defaults' step (8 completions × 512 tokens, 135M
parameters) in about 7 minutes and the demo's 24 steps (16 × 16 tokens, with resampling) in 421 s, 1.3e9 and
2e9 parameter-tokens a second. A faster CPU takes less, so the line says "about" and "on 2 cores". A GPU run is
not estimated.
"""

from __future__ import annotations

import torch

CPU_RATE = 1.5e9  # parameter × generated-token products per second, 2-core AVX2 CPU (see the module docstring)
SLOW_STEP_S = 60.0  # an estimate above this many seconds per optimizer step is said at start-up


def step_seconds(num_parameters: int, completions_per_step: int, max_completion_length: int) -> float:
    """Estimated seconds of one optimizer step on a 2-core CPU, every completion at its longest."""
    return num_parameters * completions_per_step * max_completion_length / CPU_RATE


def slow_plan_line(num_parameters: int, plan, max_completion_length: int, max_steps: int) -> str | None:
    """The warning for a CPU run whose steps are estimated above ``SLOW_STEP_S``, else None."""
    per_step = plan.per_device_train_batch_size * plan.gradient_accumulation_steps  # completions per step
    seconds = step_seconds(num_parameters, per_step, max_completion_length)
    if seconds < SLOW_STEP_S:
        return None
    total = f"; {max_steps} steps: about {_minutes(seconds * max_steps)}" if max_steps > 0 else ""
    return (
        f"this plan is slow on a CPU: each optimizer step generates up to {per_step} completions × "
        f"{max_completion_length} tokens with a {num_parameters / 1e6:.0f}M-parameter model, about "
        f"{_minutes(seconds)} a step on 2 cores{total}. For a quick first run use fewer, shorter completions "
        "(--num_generations 4 --per_device_train_batch_size 16 --max_completion_length 64) or the demo "
        "(`grpokit train`)"
    )


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def warn_if_slow(model, cfg, plan, log) -> None:
    """Say ``slow_plan_line`` once, before the first rollout, when the run trains and generates on a CPU."""
    accelerator = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    if (accelerator and not cfg.training.use_cpu) or cfg.rollout.use_vllm:
        return
    line = slow_plan_line(
        sum(p.numel() for p in model.parameters()), plan, cfg.rollout.max_completion_length, cfg.training.max_steps
    )
    if line is not None:
        log(f"grpokit: note: {line}", flush=True)
