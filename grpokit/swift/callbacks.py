"""``swift.callbacks``: ``TrainerCallback`` (a transformers ``TrainerCallback`` built as ``cls(args, trainer)``, as
ms-swift builds its callbacks) and ``callbacks_map`` (grpokit's registry behind ``--callbacks``).

The loop drives it with HF's ``(args, state, control, **kwargs)`` at the events it has (on_train_begin,
on_step_begin, on_substep_end, on_pre_optimizer_step, on_optimizer_step, on_step_end, on_log, on_evaluate, on_save,
on_train_end) and honours ``control.should_training_stop``/``should_log``/``should_evaluate``/``should_save``
(grpokit/trainers/hf_callbacks.py)."""

from __future__ import annotations

from transformers import TrainerCallback as _HFTrainerCallback

from grpokit.trainers.callbacks import callbacks_map  # noqa: F401 (re-exported)


class TrainerCallback(_HFTrainerCallback):
    """ms-swift's callback base: keeps the training ``args`` and the ``trainer``."""

    def __init__(self, args, trainer) -> None:
        self.args = args
        self.trainer = trainer


__all__ = ["TrainerCallback", "callbacks_map"]
