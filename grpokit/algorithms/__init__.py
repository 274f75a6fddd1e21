"""GRPO-family math as pure tensor functions: no models, engines, files or network; only torch.

The variant names of each option live in registries (``ADVANTAGE_ESTIMATORS``, ``SCALE_MODES``,
``POLICY_LOSSES``, ``LOSS_NORMALIZERS``, ``LOSS_CHECKS``, ``IS_LEVELS``, ``ROLLOUT_IS_MODES``) that a plugin may
extend. See docs/algorithms.md for the formulas next to their flags. The rules that check an option against these
registries (``option_checks.py``) register with config's option gate when the package is imported.
"""

from __future__ import annotations

from grpokit.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    DEFAULT_SCALE,
    SCALE_MODES,
    AdvantageContext,
    AdvantageOut,
    Centered,
    compute_advantages,
    validate_advantage_options,
)
from grpokit.algorithms.chord import chord_mix, chord_mu, chord_sft_loss
from grpokit.algorithms.chunked_logps import chunked_lm_head_logps
from grpokit.algorithms.ema import ema_update_
from grpokit.algorithms.filters import (
    entropy_mask,
    entropy_threshold,
    groups_with_signal,
    loss_mask,
    overlong_mask,
    validate_entropy_quantile,
)
from grpokit.algorithms.kept_set import SamplerSupport, kept_set_log_softmax, kept_set_logps
from grpokit.algorithms.kl import k3_kl, kl_reward_penalty
from grpokit.algorithms.logps import entropy_from_logits, selective_log_softmax
from grpokit.algorithms.losses import (
    IS_LEVELS,
    LOSS_CHECKS,
    LOSS_NORMALIZERS,
    POLICY_LOSSES,
    LossConfig,
    LossInputs,
    LossOut,
    PolicyTerms,
    TokenLoss,
    compute_policy_loss,
    num_items_per_micro_batch,
    step_token_counts,
    uses_global_token_count,
    validate_loss_config,
)
from grpokit.algorithms.losses_sequence import vespo_weights  # registers luspo and vespo
from grpokit.algorithms.off_policy_mask import behaviour_logps, off_policy_sequence_mask

# isort: split
from grpokit.algorithms.losses_real import real_group_loss, real_scores  # registers real (after vespo)
from grpokit.algorithms.rollout_is import (
    ROLLOUT_IS_MODES,
    RolloutISOut,
    mismatch_metrics,
    rollout_importance_weights,
    validate_rollout_is_options,
)

# isort: split
from grpokit.algorithms.option_checks import check_registry_names, loss_config  # the option gate's "names" rules

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DEFAULT_SCALE",
    "IS_LEVELS",
    "LOSS_CHECKS",
    "LOSS_NORMALIZERS",
    "POLICY_LOSSES",
    "ROLLOUT_IS_MODES",
    "SCALE_MODES",
    "AdvantageContext",
    "AdvantageOut",
    "behaviour_logps",
    "Centered",
    "chord_mix",
    "chord_mu",
    "check_registry_names",
    "chord_sft_loss",
    "LossConfig",
    "LossInputs",
    "loss_config",
    "LossOut",
    "PolicyTerms",
    "RolloutISOut",
    "SamplerSupport",
    "TokenLoss",
    "compute_advantages",
    "compute_policy_loss",
    "ema_update_",
    "entropy_from_logits",
    "entropy_mask",
    "entropy_threshold",
    "groups_with_signal",
    "k3_kl",
    "kept_set_log_softmax",
    "kept_set_logps",
    "kl_reward_penalty",
    "loss_mask",
    "mismatch_metrics",
    "num_items_per_micro_batch",
    "off_policy_sequence_mask",
    "overlong_mask",
    "real_group_loss",
    "real_scores",
    "rollout_importance_weights",
    "selective_log_softmax",
    "chunked_lm_head_logps",
    "step_token_counts",
    "uses_global_token_count",
    "validate_advantage_options",
    "validate_entropy_quantile",
    "validate_loss_config",
    "validate_rollout_is_options",
    "vespo_weights",
]
