"""GRPOTrainer's checkpoints: what one holds of the loop (the step, the prompt stream's frontier and the draws
taken and not trained, CHORD's position, the rest of a window it was taken inside) and how a run resumes from it.
The files themselves are RunOutputs' (run_outputs.py)."""

from __future__ import annotations

from grpokit.runs.outputs import MetricsAccumulator
from grpokit.trainers.state import StepValues, WindowProgress


class TrainerCheckpoints:
    """The checkpoint side of a GRPOTrainer."""

    def _save_checkpoint(self, values: StepValues | None = None):
        """A checkpoint at this step; inside a window (``values``) it holds the window's untrained rest too."""
        consumed, pending = self._async.loop_position()  # pending: drawn first on resume
        chord = {} if self._chord is None else {"chord_sft_consumed": self._chord.position}
        window, unlogged = (values.window, values.step_metrics.state()) if values else (None, None)
        extra = {**chord, "prompts_pending": pending, "prompts_per_draw": self._producer.prompts.prompts_per_window}
        ckpt = self._outputs.save_checkpoint(
            self.model,
            step=self.state.global_step,
            max_steps=self.state.max_steps,
            prompts_consumed=consumed,
            extra=extra,
            window=window,
            step_metrics=unlogged,
        )
        self._call("on_save", str(ckpt))
        return ckpt

    def _resume(self, step_metrics: MetricsAccumulator) -> WindowProgress | None:
        """The loop's position from the checkpoint; returns the rest of the window it was taken inside (its
        unlogged step metrics put back into ``step_metrics``), or None."""
        loop = self._outputs.resume()
        if loop is None:
            return None
        self.state.global_step = loop["global_step"]
        self.state.prompts_consumed = self._producer.prompts.restore(loop)  # the frontier, and the pending windows
        if self._chord is not None:  # mu follows global_step; the SFT rows continue where the checkpoint left
            self._chord.position = loop.get("chord_sft_consumed", 0)
        self.engine.sync_weights(self.policy)
        self._producer.weights_at = self.state.global_step
        return WindowProgress.load(loop["checkpoint"], self.accelerator.process_index, step_metrics)
