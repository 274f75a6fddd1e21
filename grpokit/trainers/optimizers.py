"""Optimizer registry for `--optimizer NAME`: name → builder(params, training_args) -> torch.optim.Optimizer."""

from __future__ import annotations

import logging

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
    kwargs = dict(lr=args.learning_rate, weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2),
                  eps=args.adam_epsilon)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except RuntimeError as e:  # a parameter on a device or of a dtype without the fused kernel
        logger.info("adamw: the per-tensor update, not the fused kernel: %s", e)
        return torch.optim.AdamW(params, **kwargs)


@optimizers_map.register("sgd")
def build_sgd(params, args):
    import torch

    return torch.optim.SGD(params, lr=args.learning_rate, weight_decay=args.weight_decay)
