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
    return SimpleNamespace(
        **flat_options,
        process_index=process_index,
        local_process_index=process_index,
        world_size=world_size,
        should_log=is_main,
        should_save=is_main,
        local_rank=process_index if world_size > 1 else -1,
    )


def build(cls: type, args: SimpleNamespace, trainer) -> Any:
    """An HF callback class built as ms-swift builds its callbacks, ``cls(args, trainer)``, where its constructor
    takes them; else ``cls()`` (a plain transformers callback)."""
    params = [
        p
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ][1:]
    required = [p for p in params if p.default is inspect.Parameter.empty]
    if len(params) >= 2:
        return cls(args, trainer)
    if len(required) == 1:
        return cls(args)
    return cls()


class HFCallbackDriver:
    """The HF callbacks of a run, their shared ``state`` and ``control``."""

    def __init__(
        self, callbacks: list, args: SimpleNamespace, *, max_steps: int, train_batch_size: int, is_main: bool
    ) -> None:
        from transformers import TrainerControl, TrainerState

        self.callbacks, self.args = callbacks, args
        self.state = TrainerState(
            max_steps=max_steps,
            logging_steps=args.logging_steps,
            eval_steps=args.eval_steps or 500,
            save_steps=args.save_steps,
            train_batch_size=train_batch_size,
            num_train_epochs=args.num_train_epochs,
            is_local_process_zero=is_main,
            is_world_process_zero=is_main,
        )
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


class RunCallbacks:
    """A run's callbacks: grpokit's (each hook gets the trainer) and transformers' (driven by an
    ``HFCallbackDriver``). ``given`` holds instances or classes (grpokit's built with no arguments, HF's as
    ``build`` says)."""

    def __init__(self, given: list, trainer, cfg, accelerator) -> None:
        is_main = accelerator.is_main_process

        def make_args():
            return hf_args(
                cfg.flat(),
                process_index=accelerator.process_index,
                world_size=accelerator.num_processes,
                is_main=is_main,
            )

        self.own, hf = [], []
        args = None
        for cb in given:
            if is_hf_callback(cb):
                if isinstance(cb, type):
                    args = args or make_args()
                    cb = build(cb, args, trainer)
                hf.append(cb)
            else:
                self.own.append(cb() if isinstance(cb, type) else cb)
        self.all = self.own + hf
        self.hf = (
            None
            if not hf
            else HFCallbackDriver(
                hf,
                args or make_args(),
                max_steps=trainer.state.max_steps,
                train_batch_size=cfg.training.per_device_train_batch_size,
                is_main=is_main,
            )
        )

    @property
    def control(self):
        """HF's TrainerControl, or None without transformers callbacks."""
        return None if self.hf is None else self.hf.control

    def stop_requested(self) -> bool:
        """A transformers callback set ``control.should_training_stop`` (the run then ends as at max_steps)."""
        return self.hf is not None and self.hf.control.should_training_stop

    def call(self, event: str, trainer, *args) -> None:
        """A grpokit event (on_train_begin, on_log, on_save, on_step_end, on_train_end) for every callback; the
        HF callbacks get it as HF's event (their on_step_end is sent earlier, before the log: ``hf_event``)."""
        for cb in self.own:
            getattr(cb, event)(trainer, *args)
        if event == "on_log":
            self.hf_event("on_log", trainer, logs=args[0])
        elif event != "on_step_end":
            self.hf_event(event, trainer)

    def hf_event(self, event: str, trainer, **kwargs) -> None:
        if self.hf is not None:
            self.hf.event(
                event,
                trainer.state,
                model=trainer.model,
                processing_class=trainer.tokenizer,
                optimizer=trainer.optimizer,
                lr_scheduler=trainer.lr_scheduler,
                **kwargs,
            )

    def new_step(self) -> None:
        if self.hf is not None:
            self.hf.new_step()
