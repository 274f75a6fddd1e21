"""Map --deepspeed / --fsdp onto accelerate's own plugins (no home-made parallelism)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from grpokit.errors import ConfigError


def accelerate_plugins(args) -> dict:
    """Keyword arguments for ``accelerate.Accelerator`` from the training options."""
    if args.deepspeed and args.fsdp:
        raise ConfigError("--deepspeed and --fsdp both set: choose one")
    if args.deepspeed:
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(f"--deepspeed {args.deepspeed}: the deepspeed package is not installed "
                              "(pip install deepspeed)")
        from accelerate.utils import DeepSpeedPlugin

        if args.deepspeed in ("zero2", "zero3"):
            plugin = DeepSpeedPlugin(zero_stage=int(args.deepspeed[-1]),
                                     gradient_accumulation_steps=args.gradient_accumulation_steps,
                                     gradient_clipping=args.max_grad_norm or None,
                                     zero3_init_flag=False)
        elif Path(args.deepspeed).is_file():
            plugin = DeepSpeedPlugin(hf_ds_config=args.deepspeed)
        else:
            raise ConfigError(f"--deepspeed {args.deepspeed}: use zero2, zero3 or a DeepSpeed JSON file path")
        return {"deepspeed_plugin": plugin}
    if args.fsdp:
        from accelerate.utils import FullyShardedDataParallelPlugin

        return {"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2)}
    return {}
