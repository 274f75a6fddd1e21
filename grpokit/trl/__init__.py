"""TRL's Python API over grpokit: ``from grpokit.trl import GRPOConfig, GRPOTrainer`` runs code written for
``from trl import GRPOConfig, GRPOTrainer`` (TRL's quickstart: ``GRPOTrainer(model=<path>, reward_funcs=f,
args=GRPOConfig(...), train_dataset=ds).train()``). Porting a script is the rename ``from trl`` → ``from
grpokit.trl``. Config fields take TRL's names where grpokit has the option (grpokit/trl/config.py lists the
differing names); a field grpokit lacks fails with a line naming it."""

from grpokit.trl.config import GRPOConfig
from grpokit.trl.trainer.grpo import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
