"""``trl.trainer.grpo_trainer``: where TRL defines ``GRPOTrainer``."""

from grpokit.trl.trainer.grpo import GRPOTrainer

__all__ = ["GRPOTrainer"]
