"""``trl.trainer``: ``GRPOTrainer``, ``GRPOConfig`` and ``utils`` (``selective_log_softmax``)."""

from grpokit.trl.config import GRPOConfig  # noqa: F401 (re-exported)
from grpokit.trl.trainer.grpo import GRPOTrainer  # noqa: F401 (re-exported)
