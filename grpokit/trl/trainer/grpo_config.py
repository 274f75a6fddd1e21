"""``trl.trainer.grpo_config``: where TRL defines ``GRPOConfig``."""

from grpokit.trl.config import GRPOConfig

__all__ = ["GRPOConfig"]
