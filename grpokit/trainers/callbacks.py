"""Callbacks hook into the training loop; plugins register them by name for `--callbacks NAME...`.

Two shapes are accepted: grpokit's ``TrainerCallback`` (each hook gets the trainer) and any transformers
``TrainerCallback`` (ms-swift's included), driven with HF's ``(args, state, control)`` (hf_callbacks.py)."""

from __future__ import annotations

from grpokit.registry import Registry


class TrainerCallback:
    """Override any of these; each receives the trainer (read ``trainer.state`` for step and metrics)."""

    def on_train_begin(self, trainer) -> None: ...
    def on_step_end(self, trainer) -> None: ...
    def on_log(self, trainer, logs: dict) -> None: ...
    def on_save(self, trainer, checkpoint_dir: str) -> None: ...
    def on_train_end(self, trainer) -> None: ...


callbacks_map = Registry("callback", "--callbacks")
