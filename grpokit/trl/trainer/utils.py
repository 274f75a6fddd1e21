"""``trl.trainer.utils``: the helpers trainer plugins import (``selective_log_softmax``: the log-probabilities of
the chosen tokens, [B, T, V] logits and [B, T] ids → [B, T])."""

from grpokit.algorithms import entropy_from_logits, selective_log_softmax  # noqa: F401 (re-exported)

__all__ = ["entropy_from_logits", "selective_log_softmax"]
