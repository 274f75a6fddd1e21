"""The loop's values: ``TrainerState`` (the run's position, with HF's ``epoch`` and ``log_history``),
``StepValues`` (what one window hands to each of its optimizer steps' logs) and ``WindowProgress``.

``WindowProgress``: where the loop is inside the current window, so that a checkpoint taken inside one resumes exactly.
A window is ``num_iterations`` passes over its micro-batches. ``WindowProgress.remaining`` yields the micro-steps not
trained yet and counts each one as it hands it out; a checkpoint saved inside a window (--save_steps that falls inside
one, or a SIGTERM) stores this process's micro-batches, the count, the window's logged metrics and the step metrics
gathered since the last log row (``window_rank<R>.pt``). A resume trains the rest of that window first, from the same
tensors, then draws the next prompts: every prompt trains exactly once and the log equals an uninterrupted run's.

``StepGuard``: non-finite optimizer steps are skipped, warned, and after ``--max_nonfinite_steps`` in a row end the
run.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from grpokit.errors import ConfigError, GrpokitError
from grpokit.runs.outputs import MetricsAccumulator, round_significant
from grpokit.template.processor import MMRow
from grpokit.trainers.batch import RolloutBatch


@dataclass
class StepValues:
    """What the loop logs at an optimizer step, carried as a value from the window to ``_on_optimizer_step``: the
    window's metrics, its timings (seconds: rollout, reward, logps, the previous sync, train so far), the
    micro-steps' metrics since the last logging step, and the window's micro-batches with how far they are trained
    (a checkpoint inside the window saves the rest)."""

    window_metrics: dict
    timing: dict
    step_metrics: MetricsAccumulator
    window: WindowProgress

    def log_row(self, step: int, step_metrics: dict, learning_rate: float) -> dict:
        """Optimizer step ``step``'s logging.jsonl row: the window's metrics, the micro-steps' (``step_metrics``,
        averaged over processes), the timings and the learning rate; floats to 6 significant digits."""
        logs = {
            **self.window_metrics,
            **step_metrics,
            **{f"timing/{k}": round(v, 4) for k, v in self.timing.items()},
            "learning_rate": learning_rate,
        }
        return {"step": step, **{k: round_significant(v) if isinstance(v, float) else v for k, v in logs.items()}}


@dataclass
class TrainerState:
    global_step: int = 0  # optimizer steps done
    max_steps: int = 0
    prompts_consumed: int = 0  # position in the prompt stream (resumable)
    windows: int = 0
    last_logs: dict = field(default_factory=dict)
    epoch: float = 0.0  # passes over the training prompts so far (HF's meaning)
    log_history: list[dict] = field(default_factory=list)  # every logged dict, in order (HF's meaning)


WINDOW_FILE = "window_rank{rank}.pt"


class WindowProgress:
    def __init__(self, micro_batches: list[RolloutBatch], num_iterations: int, metrics: dict, done: int = 0) -> None:
        self.micro_batches, self.num_iterations = micro_batches, num_iterations
        self.done = done  # micro-steps of this window handed out (the one training now included)
        self.metrics = metrics  # the window's values, logged with each of its optimizer steps

    @classmethod
    def of(cls, micro_batches: list[RolloutBatch], num_iterations: int, metrics: dict) -> WindowProgress:
        """A new window, nothing of it trained yet."""
        return cls(micro_batches, num_iterations, metrics)

    @property
    def total(self) -> int:
        return len(self.micro_batches) * self.num_iterations

    @property
    def unfinished(self) -> bool:
        return 0 < self.done < self.total

    def remaining(self) -> Iterator[RolloutBatch]:
        """The micro-steps still to train, in order (iteration by iteration)."""
        while self.done < self.total:
            micro = self.micro_batches[self.done % len(self.micro_batches)]
            self.done += 1
            yield micro

    # -- checkpoint ------------------------------------------------------------------------------------------
    def save(self, folder: Path, rank: int, step_metrics: dict) -> None:
        """This process's share of an unfinished window (nothing when the window ended at this step)."""
        if not self.unfinished:
            return
        torch.save(
            {
                "done": self.done,
                "num_iterations": self.num_iterations,
                "metrics": self.metrics,
                "step_metrics": step_metrics,
                "micro_batches": [_batch_dict(b) for b in self.micro_batches],
            },
            folder / WINDOW_FILE.format(rank=rank),
        )

    @classmethod
    def load(cls, folder: str | Path, rank: int, step_metrics: MetricsAccumulator) -> WindowProgress | None:
        """The saved rest of a window, when the checkpoint was taken inside one (None otherwise), with the step
        metrics gathered since the last log row put back into ``step_metrics``."""
        path = Path(folder) / WINDOW_FILE.format(rank=rank)
        if not path.is_file():
            return None
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            batches = [_batch(b) for b in saved["micro_batches"]]
            done, iterations = int(saved["done"]), int(saved["num_iterations"])
            unlogged, metrics = dict(saved["step_metrics"]), dict(saved["metrics"])
            MetricsAccumulator().load_state(unlogged)  # typed before the run's own accumulator takes it
        except Exception as e:  # the unpickler, the constructors and the conversions raise their own types
            raise ConfigError(
                f"--resume_from_checkpoint: {path} is unreadable "
                f"({(str(e).strip().splitlines() or [type(e).__name__])[0][:200]}); resume from an "
                "earlier checkpoint"
            ) from e
        if not batches or not 0 < done < len(batches) * iterations:
            raise ConfigError(
                f"--resume_from_checkpoint: {path} holds no unfinished window (done {done} of "
                f"{len(batches) * iterations}); resume from an earlier checkpoint"
            )
        step_metrics.load_state(unlogged)
        return cls(batches, iterations, metrics, done)


def _batch_dict(batch: RolloutBatch) -> dict:
    """A micro-batch as plain values (tensors, numbers, lists, dicts): loadable with ``weights_only=True``."""
    out = {f.name: getattr(batch, f.name) for f in fields(batch)}
    if out["mm_inputs"] is not None:
        out["mm_inputs"] = [{"tensors": r.tensors, "completion": r.completion} for r in out["mm_inputs"]]
    return out


def _batch(saved: dict) -> RolloutBatch:
    if saved.get("mm_inputs") is not None:
        saved = {**saved, "mm_inputs": [MMRow(dict(r["tensors"]), dict(r["completion"])) for r in saved["mm_inputs"]]}
    return RolloutBatch(**saved)


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
