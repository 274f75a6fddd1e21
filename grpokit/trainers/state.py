"""The loop's values: ``TrainerState`` (the run's position, with HF's ``epoch`` and ``log_history``) and
``StepValues`` (what one window hands to each of its optimizer steps' logs)."""

from __future__ import annotations

from dataclasses import dataclass, field

from grpokit.runs.outputs import MetricsAccumulator, round_significant
from grpokit.trainers.window_progress import WindowProgress


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
