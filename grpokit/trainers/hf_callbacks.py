"""transformers ``TrainerCallback`` objects (ms-swift's callbacks are such) driven by grpokit's loop: each event
gets HF's ``(args, state, control, **kwargs)``, with a real ``transformers.TrainerState`` (``global_step``,
``max_steps``, ``epoch``, ``log_history`` mirrored from the trainer's) and ``TrainerControl``, whose
``should_training_stop``, ``should_log``, ``should_evaluate`` and ``should_save`` the loop honours.

Events the loop has, in HF's order: ``on_init_end``, ``on_train_begin``, ``on_step_begin`` (first micro-step of an
optimizer step), ``on_substep_end`` (the other micro-steps), ``on_pre_optimizer_step``, ``on_optimizer_step``,
``on_step_end``, ``on_log``, ``on_evaluate``, ``on_save``, ``on_train_end``. No epoch or prediction events: the loop
counts optimizer steps over a prompt stream, and evaluation generates (no prediction steps)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any


def is_hf_callback(obj: Any) -> bool:
    """A transformers TrainerCallback class or instance (without importing transformers when it is not loaded)."""
    import sys

    tf = sys.modules.get("transformers")
    if tf is None:
        return False
    base = tf.TrainerCallback
    return (isinstance(obj, type) and issubclass(obj, base)) or isinstance(obj, base)


def hf_args(flat_options: dict, *, process_index: int, world_size: int, is_main: bool) -> SimpleNamespace:
    """TrainingArguments-like ``args``: every grpokit option by its name (grpokit's names are HF's and ms-swift's
    where they share an option), plus the process facts HF's properties give."""
    return SimpleNamespace(**flat_options, process_index=process_index, local_process_index=process_index,
                           world_size=world_size, should_log=is_main, should_save=is_main,
                           local_rank=process_index if world_size > 1 else -1)


def build(cls: type, args: SimpleNamespace, trainer) -> Any:
    """An HF callback class built as ms-swift builds its callbacks, ``cls(args, trainer)``, where its constructor
    takes them; else ``cls()`` (a plain transformers callback)."""
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
    required = [p for p in params if p.default is inspect.Parameter.empty]
    if len(params) >= 2:
        return cls(args, trainer)
    if len(required) == 1:
        return cls(args)
    return cls()


class HFCallbackDriver:
    """The HF callbacks of a run, their shared ``state`` and ``control``."""

    def __init__(self, callbacks: list, args: SimpleNamespace, *, max_steps: int, train_batch_size: int,
                 is_main: bool) -> None:
        from transformers import TrainerControl, TrainerState

        self.callbacks, self.args = callbacks, args
        self.state = TrainerState(max_steps=max_steps, logging_steps=args.logging_steps,
                                  eval_steps=args.eval_steps or 500, save_steps=args.save_steps,
                                  train_batch_size=train_batch_size, num_train_epochs=args.num_train_epochs,
                                  is_local_process_zero=is_main, is_world_process_zero=is_main)
        self.control = TrainerControl()

    def event(self, name: str, loop_state, **kwargs) -> None:
        """Mirror the loop's state, then call ``name`` on every callback; a callback returning a TrainerControl
        replaces the shared one (HF's CallbackHandler does the same)."""
        self.state.global_step, self.state.max_steps = loop_state.global_step, loop_state.max_steps
        self.state.epoch, self.state.log_history = loop_state.epoch, loop_state.log_history
        for cb in self.callbacks:
            out = getattr(cb, name)(self.args, self.state, self.control, **kwargs)
            if out is not None:
                self.control = out

    def new_step(self) -> None:
        """HF's ``control._new_step``: the per-step requests are answered once."""
        self.control.should_log = self.control.should_evaluate = self.control.should_save = False
