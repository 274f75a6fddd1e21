"""Every option of `grpokit train`, grouped by concern, with ms-swift/TRL names.

Each dataclass is one slice of the configuration, in a module of its own (``model_args``, ``data_args``,
``rollout_args``, ``algorithm_args``, ``reward_args``, ``training_args``, ``teacher_args``); a component receives only
the slice it needs. ``TrainConfig`` holds one of each. Help text is the field metadata, so `grpokit train --help`
documents every flag, slice by slice in the order of ``ALL_GROUPS``. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from grpokit.config.algorithm_args import AlgorithmArguments
from grpokit.config.data_args import DataArguments
from grpokit.config.model_args import ATTN_IMPLS, ModelArguments
from grpokit.config.reward_args import RewardArguments
from grpokit.config.rollout_args import RolloutArguments
from grpokit.config.teacher_args import TeacherArguments
from grpokit.config.training_args import TrainingArguments

__all__ = [
    "ALL_GROUPS",
    "ATTN_IMPLS",
    "AlgorithmArguments",
    "DataArguments",
    "ModelArguments",
    "RewardArguments",
    "RolloutArguments",
    "TeacherArguments",
    "TrainConfig",
    "TrainingArguments",
]

ALL_GROUPS = (
    ModelArguments,
    DataArguments,
    RolloutArguments,
    AlgorithmArguments,
    RewardArguments,
    TrainingArguments,
    TeacherArguments,
)


@dataclass
class TrainConfig:
    """The parsed configuration: one attribute per concern."""

    model: ModelArguments
    data: DataArguments
    rollout: RolloutArguments
    algorithm: AlgorithmArguments
    reward: RewardArguments
    training: TrainingArguments
    teacher: TeacherArguments = field(default_factory=TeacherArguments)  # on-policy distillation
    # ms-swift options given that grpokit warns about or refuses (config/swift_options.py): name -> value
    swift_options: dict = field(default_factory=dict)

    def flat(self) -> dict:
        """All options in one dict (args.json; reward constructors pick their kwargs from it by name)."""
        out: dict = {}
        for part in (self.model, self.data, self.rollout, self.algorithm, self.reward, self.training, self.teacher):
            out.update(asdict(part))
        return out
