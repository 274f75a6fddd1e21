"""``swift.trainers.trainer_factory``: ``TrainerFactory``, the same object as ``grpokit.swift.trainers``'."""

from grpokit.trainers.factory import TrainerFactory  # noqa: F401 (re-exported)

__all__ = ["TrainerFactory"]
