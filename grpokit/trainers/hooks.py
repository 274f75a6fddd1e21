"""What a GRPOTrainer subclass overrides, read once at set-up: which hooks it overrides (the producer calls only
those through the trainer), which calling convention an override uses, and the ms-swift/TRL methods grpokit never
calls (a subclass defining one is refused, naming the grpokit hook that does that job)."""

from __future__ import annotations

import functools
import inspect
import logging

from grpokit.distributed.processes import deepspeed_stage
from grpokit.errors import ConfigError, PluginError
from grpokit.trainers.batch import RolloutBatch
from grpokit.trainers.rollouts import WindowHooks

logger = logging.getLogger(__name__)

# ms-swift's and TRL's GRPOTrainer (and transformers.Trainer) methods that grpokit's loop never calls → the grpokit
# hook, registry or option that does their job
UNCALLED: dict[str, str] = {
    "_get_logps_via_local_forward": "_get_per_token_logps_and_entropies(model, inputs, compute_entropy) (the one "
    "entry for old, ref and current logps)",
    "_get_per_token_logps": "_get_per_token_logps_and_entropies(model, inputs, compute_entropy)",
    "_get_last_hidden_state": "_get_per_token_logps_and_entropies (forward with output_hidden_states there)",
    "_generate_and_score_completions": "_prepare_inputs(prompts, rollout=None) (or _generate_completions, "
    "_score_completions, _compute_advantages, _prepare_batch_inputs)",
    "_generate": "_generate_completions(requests)",
    "_generate_single_turn": "_generate_completions(requests)",
    "_fast_infer": "_generate_completions(requests)",
    "_infer_single_or_multi_turn": "_generate_completions(requests) (multi-turn: a MultiTurnScheduler)",
    "_calculate_rewards": "_score_completions(requests, outputs)",
    "_compute_rewards_per_func": "_score_completions(requests, outputs)",
    "compute_loss": "_compute_loss_and_metrics(model, inputs)",
    "_compute_loss": "_compute_loss_and_metrics(model, inputs)",
    "compute_liger_loss": "_compute_loss_and_metrics(model, inputs)",
    "get_high_entropy_mask": "--top_entropy_quantile, or _compute_loss_and_metrics",
    "_compute_off_policy_sequence_mask": "--off_policy_sequence_mask_delta, or _compute_loss_and_metrics",
    "split_by_mini_batches": "_prepare_batch_inputs(inputs)",
    "_dynamic_sampling": "--dynamic_sample true (or _prepare_inputs)",
    "_move_model_to_vllm": "the engine's sync_weights (grpokit/engines)",
    "_sync_and_move_model": "the engine's sync_weights (grpokit/engines)",
    "create_optimizer": "an optimizers_map entry (--optimizer NAME): a builder or an OptimizerCallback",
    "create_scheduler": "an OptimizerCallback's create_scheduler in optimizers_map (--optimizer NAME)",
    "create_optimizer_and_scheduler": "an OptimizerCallback in optimizers_map (--optimizer NAME)",
    "_inner_training_loop": "train()",
    "_maybe_log_save_evaluate": "a callback in callbacks_map (--callbacks NAME)",
    "log": "a callback's on_log (callbacks_map, --callbacks NAME)",
    "prediction_step": "evaluate()",
    "evaluation_loop": "evaluate()",
    "get_train_dataloader": "the prompt stream (--dataset, --dataset_shuffle)",
    "_get_train_sampler": "the prompt stream (--dataset, --dataset_shuffle)",
    "_prepare_algorithm_params": "the options (--loss_type, --advantage_estimator, ...) read in __init__",
}


def overrides(cls: type, base: type, name: str) -> bool:
    """Whether ``cls`` (a subclass of ``base``) defines ``name`` itself or in a class between it and ``base``."""
    return getattr(cls, name, None) is not getattr(base, name, None)


def check_subclass(cls: type, base: type) -> None:
    """Refuse a subclass that defines a method ms-swift or TRL would call and grpokit never does."""
    for klass in cls.__mro__:
        if klass is base or issubclass(base, klass):
            break
        for name in klass.__dict__:
            if name in UNCALLED:
                raise ConfigError(
                    f"{klass.__module__}.{klass.__qualname__} defines {name}(), which grpokit never "
                    f"calls (an ms-swift/TRL method); move it to {UNCALLED[name]}"
                )


def positional_count(method) -> int:
    """How many positional arguments a bound method takes (``*args`` counts as many)."""
    params = inspect.signature(method).parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 99
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def loss_convention(method) -> str:
    """``"batch"`` for ``_compute_loss_and_metrics(model, inputs)`` (the seed's), ``"swift46"`` for ms-swift 4.6's
    ``(model, model_inputs, grpo_batch)``: told apart by the override's parameters."""
    params = [
        p
        for p in inspect.signature(method).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(params) >= 3 and params[2].default is inspect.Parameter.empty:
        return "swift46"
    return "batch"


def warn_sharded_grad_edit(cls: type, base: type, args) -> None:
    """The seed's trap (its mechanism 3), said once at start-up: under DeepSpeed ZeRO >= 2 and FSDP ``p.grad`` is
    not the full gradient, so a ``training_step`` override that edits it does not do what it does on one GPU."""
    if not overrides(cls, base, "training_step"):
        return
    stage = deepspeed_stage(args.deepspeed) if args.deepspeed else None
    if args.fsdp or (stage is not None and stage >= 2):
        how = "--fsdp" if args.fsdp else f"--deepspeed {args.deepspeed} (ZeRO-{stage})"
        logger.warning(
            "%s overrides training_step: under %s p.grad is not the full gradient (sharded, or None under "
            "DeepSpeed), so a gradient edit there does not see it; edit gradients in the loss (detach "
            "algebra, a tensor hook, an autograd.Function) or in an optimizer from optimizers_map",
            cls.__qualname__,
            how,
        )


def loss_caller(method, cls: type, base: type):
    """How the loop calls ``_compute_loss_and_metrics``, decided once: the method itself when ``cls`` keeps the
    base's; an override through ``call_loss``, in its convention, its result checked."""
    if not overrides(cls, base, "_compute_loss_and_metrics"):
        return method
    return functools.partial(call_loss, method, loss_convention(method))


def call_loss(method, convention: str, model, inputs):
    """``_compute_loss_and_metrics`` in the convention its override uses (loss_convention), its result checked."""
    out = method(model, inputs, inputs) if convention == "swift46" else method(model, inputs)
    if not (isinstance(out, tuple) and len(out) == 2 and hasattr(out[0], "backward")):
        raise PluginError(
            f"_compute_loss_and_metrics returned {type(out).__name__}; return (loss tensor, metrics dict)"
        )
    return out[0], dict(out[1] or {})


def loss_batch(inputs, grpo_batch):
    """The batch ``_compute_loss_and_metrics`` computes on: ``inputs`` (the seed's call), or ``grpo_batch`` in ms-swift
    4.6's ``(model, model_inputs, grpo_batch)``, where both must be the batch objects the loop passed."""
    if grpo_batch is None:
        return inputs
    if not isinstance(grpo_batch, RolloutBatch) or not isinstance(inputs, RolloutBatch):
        raise PluginError(
            "_compute_loss_and_metrics(model, model_inputs, grpo_batch): pass on the batch objects it "
            "was called with (change the forward's inputs in _prepare_model_inputs)"
        )
    return grpo_batch


def window_hooks(trainer, base: type, plain_logps):
    """A WindowProducer's callables: the trainer's bound methods for the hooks its class overrides (so they apply),
    None for the rest (the producer then runs its own defaults, without a detour through the trainer); for logps,
    ``plain_logps`` (trainers/forward.py) unless the forward's hooks are overridden."""

    def mine(name: str):
        return getattr(trainer, name) if overrides(type(trainer), base, name) else None

    forward = ("_get_per_token_logps_and_entropies", "_prepare_model_inputs")
    custom = any(overrides(type(trainer), base, name) for name in forward)
    return WindowHooks(
        logps=trainer._get_per_token_logps_and_entropies if custom else plain_logps,
        progress=trainer._progress,
        generate=mine("_generate_completions"),
        score=mine("_score_completions"),
        prepare_batches=mine("_prepare_batch_inputs"),
        advantages=mine("_compute_advantages"),
    )
