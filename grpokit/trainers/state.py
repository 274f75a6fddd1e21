"""The loop's values: ``TrainerState`` (the run's position, with HF's ``epoch`` and ``log_history``),
``StepValues`` (what one window hands to each of its optimizer steps' logs) and ``WindowProgress``.

``WindowProgress``: where the loop is inside the current window, so that a checkpoint taken inside one resumes exactly.
A window is ``num_iterations`` passes over its micro-batches. ``WindowProgress.remaining`` yields the micro-steps not
trained yet and counts each one as it hands it out; a checkpoint saved inside a window (--save_steps that falls inside
one, or a SIGTERM) stores this process's micro-batches, the count, the window's logged metrics and the step metrics
gathered since the last log row (``window_rank<R>.pt``). A resume trains the rest of that window first, from the same
tensors, then draws the next prompts: every prompt trains exactly once and the log equals an uninterrupted run's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from grpokit.errors import ConfigError
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
