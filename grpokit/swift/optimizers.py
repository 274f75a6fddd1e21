"""``swift.optimizers``: ``OptimizerCallback`` and ``optimizers_map`` (grpokit's registry behind ``--optimizer``).

``optimizers_map['my_opt'] = MyOptimizerCallback`` registers ms-swift's shape: the class is built as
``MyOptimizerCallback(args, trainer)`` and asked for ``create_optimizer()`` and ``create_scheduler(num_training_steps,
optimizer)`` (the defaults: AdamW and the --lr_scheduler_type schedule). grpokit's own shape, a
``builder(params, args)`` function, goes into the same registry."""

from grpokit.trainers.optimizers import OptimizerCallback, optimizers_map  # noqa: F401 (re-exported)

__all__ = ["OptimizerCallback", "optimizers_map"]
