"""The options that name what a plugin may add to the algorithm registries, checked by this package.

Registered with the option gate (``grpokit.config.checks``, slot ``names``): config imports no runtime package, so
the rules that look names up in ``POLICY_LOSSES`` and friends live here. They run as soon as the registries are
final: in ``validate`` when no ``--external_plugins`` are given, else in the pipeline right after the plugins
load (still before any model). Importing ``grpokit.algorithms`` also hands the live registries to ``--help``
(``config/names.py``).
"""

from __future__ import annotations

from grpokit.algorithms.advantages import ADVANTAGE_ESTIMATORS, SCALE_MODES, validate_advantage_options
from grpokit.algorithms.filters import validate_entropy_quantile
from grpokit.algorithms.losses import IS_LEVELS, LOSS_NORMALIZERS, POLICY_LOSSES, LossConfig, validate_loss_config
from grpokit.algorithms.rollout_is import ROLLOUT_IS_MODES, validate_rollout_is_options
from grpokit.config.args import TrainConfig
from grpokit.config.checks import option_check
from grpokit.config.names import LIVE, REGISTRIES
from grpokit.errors import ConfigError

_REGISTRIES = {
    "ADVANTAGE_ESTIMATORS": ADVANTAGE_ESTIMATORS,
    "SCALE_MODES": SCALE_MODES,
    "POLICY_LOSSES": POLICY_LOSSES,
    "LOSS_NORMALIZERS": LOSS_NORMALIZERS,
    "IS_LEVELS": IS_LEVELS,
    "ROLLOUT_IS_MODES": ROLLOUT_IS_MODES,
}
LIVE.update({option: tuple(_REGISTRIES[attr] for attr in attrs) for option, attrs in REGISTRIES.items()})


@option_check("names")
def check_registry_names(cfg: TrainConfig) -> None:
    """The options whose values are names in registries a plugin may extend, with the rules that look them up."""
    a = cfg.algorithm
    check_loss_type_pair(a.loss_type)
    validate_advantage_options(a.advantage_estimator, a.scale_rewards, a.kl_in_reward and a.beta != 0)
    validate_loss_config(loss_config(cfg))
    validate_entropy_quantile(a.top_entropy_quantile)
    validate_rollout_is_options(
        a.rollout_importance_sampling_mode, a.rollout_importance_sampling_threshold, a.use_rollout_logprobs
    )


def loss_config(cfg: TrainConfig) -> LossConfig:
    """The loss slice of the configuration. cispo's default cap 5.0 is grpokit's: the value the docs of ms-swift
    (CISPO page) and TRL (epsilon_high) recommend after ScaleRL; the code of both falls back to --epsilon."""
    a = cfg.algorithm
    high = a.epsilon_high
    if high is None:
        high = 5.0 if a.loss_type == "cispo" else a.epsilon
    return LossConfig(
        loss_type=a.loss_type,
        importance_sampling_level=a.importance_sampling_level,
        epsilon_low=a.epsilon,
        epsilon_high=high,
        delta=a.delta,
        beta=0.0 if a.kl_in_reward else a.beta,
        tau_pos=a.tau_pos,
        tau_neg=a.tau_neg,
        max_completion_length=cfg.rollout.max_completion_length,
        vespo_k_pos=a.vespo_k_pos,
        vespo_lambda_pos=a.vespo_lambda_pos,
        vespo_k_neg=a.vespo_k_neg,
        vespo_lambda_neg=a.vespo_lambda_neg,
        rollout_importance_sampling_mode=a.rollout_importance_sampling_mode,
        real_tau=a.real_tau,
        num_generations=cfg.rollout.num_generations,
        kl_bias_correction=a.kl_bias_correction,
    )


def check_loss_type_pair(loss_type: str) -> None:
    """A loss type is a per-token loss (POLICY_LOSSES) plus its normaliser (LOSS_NORMALIZERS): name the missing
    half instead of reporting the name as unknown. ms-swift's fipo is refused as not implemented (unless a plugin
    registers it)."""
    if loss_type == "fipo" and loss_type not in POLICY_LOSSES:
        raise ConfigError(
            "--loss_type fipo: ms-swift's FIPO (future-KL influence weights on the PPO-clip loss) is not "
            "implemented in grpokit; use another --loss_type (e.g. grpo, dapo or real)"
        )
    POLICY_LOSSES.get_or_raise(loss_type)
    if loss_type not in LOSS_NORMALIZERS:
        raise ConfigError(
            f"--loss_type {loss_type!r} is registered in POLICY_LOSSES but not in LOSS_NORMALIZERS; a "
            f"loss type needs both: add LOSS_NORMALIZERS[{loss_type!r}] = <normaliser> in the plugin "
            "(e.g. grpokit.algorithms.losses.token_mean; docs/plugins.md)"
        )
