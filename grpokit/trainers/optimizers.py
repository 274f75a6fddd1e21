"""Optimizer registry for `--optimizer NAME`: name → builder(params, training_args) -> torch.optim.Optimizer."""

from __future__ import annotations

from grpokit.registry import Registry

optimizers_map = Registry("optimizer", "--optimizer")


@optimizers_map.register("adamw")
def build_adamw(params, args):
    import torch

    return torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay,
                             betas=(args.adam_beta1, args.adam_beta2))


@optimizers_map.register("sgd")
def build_sgd(params, args):
    import torch

    return torch.optim.SGD(params, lr=args.learning_rate, weight_decay=args.weight_decay)
