"""`grpokit train`'s algorithm options (the AlgorithmArguments slice of ``TrainConfig``): advantages, the loss family,
KL, masks, importance sampling and CHORD."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from grpokit.config.fields import opt as _opt


@dataclass
class AlgorithmArguments:
    # names from registries that plugins may extend: checked after --external_plugins load (config/names.py)
    advantage_estimator: str = _opt("grpo", "advantage estimator (ADVANTAGE_ESTIMATORS)")
    scale_rewards: str | None = _opt(
        None,
        "advantage scaling (SCALE_MODES; default by estimator: grpo→group, "
        "rloo→none, reinforce_plus_plus→batch, any other→group)",
    )
    loss_type: str = _opt("grpo", "loss and its normalisation (POLICY_LOSSES and LOSS_NORMALIZERS)")
    importance_sampling_level: str = _opt(
        "token", "importance sampling level (IS_LEVELS): token = GRPO, sequence = GSPO, sequence_token = GSPO-token"
    )
    beta: float = _opt(0.04, "KL coefficient (k3 estimator); 0 skips the reference model", ge=0)
    epsilon: float = _opt(0.2, "PPO clip range (lower)", ge=0)
    epsilon_high: float | None = _opt(
        None, "upper clip range (clip-higher, DAPO); default = epsilon; cispo: the cap on the IS weight", ge=0
    )
    delta: float | None = _opt(None, "two-sided clip: upper bound on the ratio for negative advantages", gt=1)
    tau_pos: float = _opt(1.0, "sapo temperature for positive advantages", gt=0)
    tau_neg: float = _opt(1.05, "sapo temperature for negative advantages", gt=0)
    vespo_k_pos: float = _opt(2.0, "vespo: power k of the Gamma kernel W^k·e^(λ(1−W)) for advantages >= 0", ge=0)
    vespo_lambda_pos: float = _opt(3.0, "vespo: decay λ of the Gamma kernel for advantages >= 0", gt=0)
    vespo_k_neg: float = _opt(3.0, "vespo: power k of the Gamma kernel for negative advantages", ge=0)
    vespo_lambda_neg: float = _opt(2.0, "vespo: decay λ of the Gamma kernel for negative advantages", gt=0)
    real_tau: float = _opt(0.5, "real: temperature τ of REAL's in-group classification loss (logits s/τ)", gt=0)
    kl_in_reward: bool | None = _opt(
        None,
        "subtract β·KL from the reward instead of adding it to the loss; unset: "
        "true with rloo and reinforce_plus_plus, false otherwise (ms-swift's rule)",
    )
    num_iterations: int = _opt(1, "updates per rollout (μ)", ge=1)
    dynamic_sample: bool = _opt(False, "DAPO dynamic sampling: resample groups whose rewards are all equal")
    max_resample_times: int = _opt(3, "dynamic sampling: max extra rollout rounds per window", ge=0)
    overlong_filter: bool = _opt(False, "truncated completions contribute no loss")
    top_entropy_quantile: float = _opt(1.0, "train only the top-q highest-entropy tokens (global quantile)", gt=0, le=1)
    log_entropy: bool = _opt(False, "log token entropy")
    kl_bias_correction: bool = _opt(
        False,
        "--beta: each token's KL times its importance ratio, the unbiased "
        "reverse-KL gradient off-policy (DeepSeek-V3.2; TRL's "
        "use_bias_correction_kl)",
    )
    rollout_importance_sampling_mode: str | None = _opt(
        None, "correct the rollout-vs-training mismatch with the engine's logprobs (ROLLOUT_IS_MODES)"
    )
    rollout_importance_sampling_threshold: float = _opt(2.0, "rollout IS threshold C", ge=1)
    use_rollout_logprobs: bool = _opt(
        False,
        "slime's --use-rollout-logprobs (verl's bypass mode): the engine's logprobs of the sampled tokens are "
        "the old policy's in the clipped ratio, so no forward recomputes them. They equal the trainer's up to "
        "the sampler's numerics (the mismatch/* metrics show how far); every trained token needs one",
    )
    logps_support: Literal["sampler", "full"] = _opt(
        "sampler",
        "the support of the training logps (old, current, reference) when sampling truncates (top_k, "
        "top_p < 1, special tokens an engine never emits): sampler renormalises each token's probability "
        "over the tokens the sampler kept, rebuilt from the logits by the sampler's rule, so the policy "
        "ratio compares the distributions that were sampled from (costs a top-k or a vocabulary sort "
        "per token); full uses the whole vocabulary (cheaper, but with top_p < 1 every ratio to the "
        "engine's logprobs is scaled by the kept mass)",
    )
    sync_ref_model: bool = _opt(False, "mix the policy into the reference model every ref_model_sync_steps")
    ref_model_sync_steps: int = _opt(512, "steps between reference-model syncs", ge=1)
    ref_model_mixup_alpha: float = _opt(0.6, "ref ← α·policy + (1−α)·ref", ge=0, le=1)
    # CHORD: SFT on expert replies mixed into the GRPO loss (algorithms/chord.py, trainers/chord_sft.py)
    chord_sft_dataset: list[str] = _opt(
        [],
        "CHORD: expert data, same forms and columns as --dataset; each row's "
        "reference reply (final assistant message, or solution/answer/"
        "response/output/completion) is the SFT target",
    )
    chord_sft_per_device_train_batch_size: int | None = _opt(
        None, "CHORD: SFT rows per micro-step per process (required with --chord_sft_dataset)", ge=1
    )
    chord_enable_phi_function: bool = _opt(False, "CHORD-phi: weight each expert token's loss by p·(1−p)")
    chord_mu_warmup_steps: int | None = _opt(
        None, "CHORD: steps for mu to rise linearly from 0 to --chord_mu_peak (unset: 0)", ge=0
    )
    chord_mu_decay_steps: int | None = _opt(
        None, "CHORD: steps for mu's cosine decay from peak to valley (unset: 0)", ge=0
    )
    chord_mu_peak: float | None = _opt(
        None, "CHORD: mu's peak; loss = (1−mu)·GRPO + mu·SFT (required with --chord_sft_dataset)", ge=0, le=1
    )
    chord_mu_valley: float | None = _opt(
        None,
        "CHORD: mu's final value after the decay (required with --chord_sft_dataset; equal to the peak: a constant mu)",
        ge=0,
        le=1,
    )
    off_policy_sequence_mask_delta: float | None = _opt(
        None,
        "DeepSeek-V3.2: a sequence with a negative advantage whose mean log π_old − log π_θ per token exceeds "
        "this gets no policy loss (π_old: the engine's logprobs, else the old logps)",
        ge=0,
        why="unset: no mask",
    )
