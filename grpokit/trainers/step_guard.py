"""Non-finite optimizer steps: skipped, warned, and after ``--max_nonfinite_steps`` in a row, the end of the run.

A step whose loss or gradient norm is NaN or inf would write NaN into every weight it touches, and the next
rollout would then sample from NaN logits. ``StepGuard.check(loss, grad_norm)`` is called where the optimizer step
is about to happen (after the backward of the last micro-step, the gradients clipped); it returns True to step,
False to skip. A skipped step leaves the weights as they were, and the caller zeroes the gradients. The step still
counts as an optimizer step (the schedule, logging and checkpoints stay on their grid, so a resume lines up).

Under several processes the verdict must be the same on every rank (a rank that skips while another steps would
leave the replicas apart), so ``check`` takes a ``reduce`` that combines the flags of all ranks (the largest wins);
the grad norm after clipping is already global, the per-rank loss is not.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from grpokit.errors import ConfigError, GrpokitError

logger = logging.getLogger(__name__)


class NonFiniteStepsError(GrpokitError, RuntimeError):
    """Too many optimizer steps in a row had a NaN/inf loss or grad norm."""


def _non_finite(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, torch.Tensor):
        return not bool(torch.isfinite(value.detach()).all())
    return not math.isfinite(float(value))


def grads_finite(params) -> bool:
    """True when every gradient of ``params`` is finite: the check for a step without a grad norm (clipping
    off). One fused norm per device and dtype; a NaN or inf anywhere makes the norm non-finite."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return True
    norms = torch._foreach_norm(grads)
    return bool(torch.isfinite(torch.stack([n.float().to(norms[0].device) for n in norms])).all())


class StepGuard:
    """Counts non-finite optimizer steps in a row; ``max_in_a_row`` is ``--max_nonfinite_steps``."""

    def __init__(self, max_in_a_row: int, option: str = "--max_nonfinite_steps") -> None:
        if isinstance(max_in_a_row, bool) or not isinstance(max_in_a_row, int) or max_in_a_row < 1:
            raise ConfigError(
                f"{option} {max_in_a_row!r}: must be a whole number ≥ 1 (the non-finite steps in a "
                "row after which the run stops)"
            )
        self.max_in_a_row = max_in_a_row
        self.option = option
        self.in_a_row = 0
        self.skipped = 0  # over the whole run

    def check(
        self,
        loss: Any,
        grad_norm: Any = None,
        *,
        step: int | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        params=None,
    ) -> bool:
        """True: take the optimizer step. False: skip it (a warning line; the caller zeroes the gradients).
        ``grad_norm`` None with ``params`` given: the gradients themselves are checked (clipping off).
        NonFiniteStepsError after ``max_in_a_row`` skips in a row. ``step``: the 1-based step, for the messages."""
        bad_loss, bad_norm = _non_finite(loss), _non_finite(grad_norm)
        if grad_norm is None and params is not None and not bad_loss:
            bad_norm = not grads_finite(params)
        flag = float(bad_loss or bad_norm)
        if reduce is not None:
            flag = float(reduce(torch.tensor([flag])).max())
        if not flag:
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.skipped += 1
        what = (
            " and ".join(w for w, bad in (("loss", bad_loss), ("grad norm", bad_norm)) if bad)
            or "loss or grad norm on another process"
        )
        at = f"step {step}: " if step is not None else ""
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteStepsError(
                f"{at}non-finite {what} in {self.in_a_row} optimizer steps in a row ({self.option} "
                f"{self.max_in_a_row}); training diverged: lower --learning_rate, keep --max_grad_norm on, or check "
                "the rewards and the data"
            )
        logger.warning(
            "%snon-finite %s (loss %s, grad norm %s); optimizer step skipped, weights unchanged (%d in "
            "a row stop the run, %s %d)",
            at,
            what,
            _show(loss),
            _show(grad_norm),
            self.max_in_a_row,
            self.option,
            self.max_in_a_row,
        )
        return False

    def allow_step(self, accelerator, loss: Any, grad_norm: Any, *, step: int, params) -> bool:
        """``check`` at the optimizer step of an ``accelerate`` loop. Always True on the micro-steps between
        optimizer steps, under a float16 grad scaler (it skips inf steps itself, and its first steps overflow by
        design) and under DeepSpeed (its engine steps on every micro-step and keeps its own overflow check)."""
        from accelerate.utils import DistributedType

        if (
            not accelerator.sync_gradients
            or accelerator.scaler is not None
            or accelerator.distributed_type == DistributedType.DEEPSPEED
        ):
            return True
        reduce = None
        if accelerator.num_processes > 1:

            def reduce(flag: torch.Tensor) -> torch.Tensor:
                return accelerator.reduce(flag.to(accelerator.device), "sum")

        return self.check(loss, grad_norm, step=step, reduce=reduce, params=params)

    def state_dict(self) -> dict[str, int]:
        return {"in_a_row": self.in_a_row, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.in_a_row, self.skipped = int(state.get("in_a_row", 0)), int(state.get("skipped", 0))


def _show(value: Any) -> str:
    if value is None:
        return "-"
    v = float(value.detach().float().reshape(-1)[0]) if isinstance(value, torch.Tensor) else float(value)
    return f"{v:g}"
