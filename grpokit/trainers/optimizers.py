"""Optimizer registry for `--optimizer NAME`. An entry is either grpokit's ``builder(params, training_args) ->
torch.optim.Optimizer`` or ms-swift's ``OptimizerCallback`` class, built as ``cls(args, trainer)`` and asked for
``create_optimizer()`` and ``create_scheduler(num_training_steps, optimizer)``; the learning-rate schedule is
grpokit's (--lr_scheduler_type) unless the callback makes its own."""

from __future__ import annotations

import logging
import math

from grpokit.config.validate import json_object
from grpokit.errors import ConfigError, PluginError
from grpokit.registry import Registry

logger = logging.getLogger(__name__)

optimizers_map = Registry("optimizer", "--optimizer")


@optimizers_map.register("adamw")
def build_adamw(params, args):
    """AdamW with torch's fused kernel where every parameter allows it (floating point, on a device type torch
    has the kernel for: CPU and CUDA among them), else the per-tensor loop. The fused step is the same update in
    one pass per tensor instead of several small ops per tensor (figures: docs/PERFORMANCE.md). transformers'
    default ``adamw_torch_fused`` is this kernel."""
    import torch

    params = list(params)
    kwargs = dict(
        lr=args.learning_rate,
        weight_decay=args.weight_decay,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
    )
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except RuntimeError as e:  # a parameter on a device or of a dtype without the fused kernel
        logger.info("adamw: the per-tensor update, not the fused kernel: %s", e)
        return torch.optim.AdamW(params, **kwargs)


@optimizers_map.register("sgd")
def build_sgd(params, args):
    import torch

    return torch.optim.SGD(params, lr=args.learning_rate, weight_decay=args.weight_decay)


class OptimizerCallback:
    """ms-swift's optimizer plugin shape: ``OptimizerCallback(args, trainer)``; override ``create_optimizer`` (and
    ``create_scheduler`` for a schedule of your own). ``args`` is the training options (``learning_rate``,
    ``weight_decay``, ``adam_beta1`` ...), ``trainer.model`` the model before any wrapper. The defaults are
    grpokit's AdamW over the trainable parameters and the --lr_scheduler_type schedule."""

    def __init__(self, args, trainer) -> None:
        self.args = args
        self.trainer = trainer

    def create_optimizer(self, model=None):
        model = model if model is not None else self.trainer.model
        return build_adamw([p for p in model.parameters() if p.requires_grad], self.args)

    def create_scheduler(self, num_training_steps: int, optimizer):
        return lr_schedule(self.args, optimizer, num_training_steps)


def build_optimizer(entry, params, args, trainer, max_steps: int):
    """The optimizer and learning-rate schedule of an ``optimizers_map`` entry: a builder function, or an
    OptimizerCallback class (any class with ``create_optimizer``)."""
    import torch

    if not (isinstance(entry, type) and hasattr(entry, "create_optimizer")):
        return _builder(entry, params, args, max_steps)
    name = f"{entry.__module__}.{entry.__qualname__}"
    if "create_optimizer_and_scheduler" in vars(entry):
        raise PluginError(
            f"{name} overrides create_optimizer_and_scheduler, which grpokit does not call; override "
            "create_optimizer() and create_scheduler(num_training_steps, optimizer) instead"
        )
    if trainer is None:
        raise ConfigError(f"--optimizer {name}: an OptimizerCallback needs the trainer; build it through GRPOTrainer")
    callback = entry(args, trainer)
    optimizer = callback.create_optimizer()
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise PluginError(
            f"{name}.create_optimizer() returned {type(optimizer).__name__}; return a torch.optim.Optimizer"
        )
    scheduler = callback.create_scheduler(max_steps, optimizer)
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise PluginError(
            f"{name}.create_scheduler() returned {type(scheduler).__name__}; return a "
            "torch.optim.lr_scheduler.LRScheduler (or leave the default)"
        )
    return optimizer, scheduler


def _builder(entry, params, args, max_steps: int):
    optimizer = entry(params, args)
    return optimizer, lr_schedule(args, optimizer, max_steps)


def lr_schedule(t, optimizer, max_steps: int):
    """transformers' schedule for --lr_scheduler_type, with the warm-up and --lr_scheduler_kwargs."""
    from transformers import get_scheduler  # transformers loads on first use: `grpokit --help` is fast

    extra = json_object("lr_scheduler_kwargs", t.lr_scheduler_kwargs)
    try:
        return get_scheduler(
            t.lr_scheduler_type,
            optimizer,
            num_warmup_steps=num_warmup_steps(t, max_steps),
            num_training_steps=max_steps,
            scheduler_specific_kwargs=extra,
        )
    except (ValueError, TypeError) as e:
        option = f"--lr_scheduler_type {t.lr_scheduler_type}"
        if extra:
            option = f"--lr_scheduler_kwargs {t.lr_scheduler_kwargs} with {option}"
        raise ConfigError(f"{option}: {str(e).splitlines()[0]}") from e


def num_warmup_steps(t, max_steps: int) -> int:
    """--warmup_steps (below 1: a fraction of the steps, as transformers 5 reads it) or else --warmup_ratio."""
    if t.warmup_steps >= 1:
        return int(t.warmup_steps)
    return math.ceil((t.warmup_steps or t.warmup_ratio) * max_steps)
