"""``swift.rlhf_trainers``: ``GRPOTrainer``, grpokit's trainer. A ported subclass overrides the seed's hooks with
the seed's signatures (``_get_per_token_logps_and_entropies``, ``_compute_loss_and_metrics``,
``_compute_advantages``, ``_prepare_batch_inputs``, ``training_step`` ...); the batch a hook gets reads as ms-swift's
mini-batch dict. A method ms-swift calls and grpokit does not is refused at start-up (grpokit/trainers/hooks.py)."""

from grpokit.trainers.grpo_trainer import GRPOTrainer  # noqa: F401 (re-exported)

__all__ = ["GRPOTrainer"]
