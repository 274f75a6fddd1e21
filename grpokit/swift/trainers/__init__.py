"""``swift.trainers``: ``TrainerFactory`` (``TrainerFactory.TRAINER_MAPPING['grpo'] = 'my_plugin.MyTrainer'`` in a
plugin file points the run at a subclass) and ``TrainerCallback``."""

from grpokit.swift.callbacks import TrainerCallback  # noqa: F401 (re-exported)
from grpokit.trainers.factory import TrainerFactory  # noqa: F401 (re-exported)

__all__ = ["TrainerCallback", "TrainerFactory"]
