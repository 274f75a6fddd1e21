"""TRL's Python API over grpokit: ``from grpokit.trl import GRPOConfig, GRPOTrainer`` runs code written for
``from trl import GRPOConfig, GRPOTrainer`` (TRL 1.16's GRPO surface: the trainer's arguments, ``GRPOConfig``'s
fields with TRL's defaults, ``trl.rewards``). Porting a script is the rename ``from trl`` → ``from grpokit.trl``;
``grpokit/trl/fields.py`` says what each GRPOConfig field does here, and a field not implemented stops with one
line naming it."""

from grpokit.trl.config import GRPOConfig
from grpokit.trl.trainer.grpo import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
