"""Set-up of a training run as values: the accelerator with the prepared model, optimizer and schedule; the
engine and scheduler wiring; the rewards. Each function checks its own options and raises ConfigError."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from grpokit.config.args import TrainConfig
from grpokit.config.moot import installed_trackers
from grpokit.config.plan import BatchPlan
from grpokit.distributed.processes import accelerate_plugins, check_backend, check_engine, deepspeed_stage, use_cpu
from grpokit.distributed.sharding import GatheredWeightsEngine, checkpoint_hooks, generation_copy, shard_model
from grpokit.distributed.zero import (
    EngineStep,
    ProcessGroupLease,
    deepspeed_config,
    ensure_process_group,
    is_zero3,
    released_on_error,
)
from grpokit.distributed.zero import checkpoint_hooks as checkpoint_hooks_deepspeed
from grpokit.distributed.zero import initialize as zero_initialize
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.errors import ConfigError
from grpokit.modeling import resolve_dtype_name
from grpokit.rewards.runner import RewardRunner
from grpokit.rollout.scheduler import RolloutScheduler
from grpokit.template.encode import ChatTemplate
from grpokit.template.prompts import PromptOptions
from grpokit.trainers.optimizers import build_optimizer, lr_schedule, num_warmup_steps, optimizers_map  # noqa: F401
from grpokit.trainers.rollouts import Rewards
from grpokit.trainers.teachers import Teachers


@dataclass
class TrainingParts:
    """What ``setup_training`` prepared. ``policy`` is the model inside any DDP/DeepSpeed wrapper (fixed from
    here on: unwrap_model walks every module and probes imports on each call)."""

    accelerator: Any
    model: Any
    policy: Any
    optimizer: Any
    lr_scheduler: Any
    ref_model: Any
    trainable_params: list[torch.nn.Parameter]
    max_steps: int
    template: ChatTemplate
    generation_model: Any = None  # --fsdp: a whole copy of the policy for the in-process engine (sharding.py)
    process_group: ProcessGroupLease = field(default_factory=ProcessGroupLease)  # formed for this run, if one was
    teachers: Teachers | None = None  # on-policy distillation (--teacher_model, --teacher_model_server)


def setup_training(
    model,
    ref_model,
    tokenizer,
    cfg: TrainConfig,
    plan: BatchPlan,
    num_prompts: int,
    engine_given: bool = False,
    owner=None,
    template: ChatTemplate | None = None,
) -> TrainingParts:
    """The accelerator (seeded, checked), then the model, optimizer and learning-rate schedule prepared by it
    (or wrapped by grpokit: --fsdp, --deepspeed), the reference model where the KL term needs one, and the
    teachers of on-policy distillation (trainers/teachers.py), if any.
    ``engine_given``: an engine with weights of its own (vLLM, a rollout server) generates, so a sharded policy
    needs no whole copy for the in-process engine. ``owner``: the trainer being built, handed to an
    ``OptimizerCallback`` (``trainer.model`` is the model before any wrapper at that point). ``template``: the
    run's chat template, built once by the pipeline; None (a trainer built in code): made here from the options.

    --fsdp or --deepspeed in a single process started without a launcher: a one-process group is formed here,
    and its lease (``parts.process_group``) is the caller's to release at the end of the run; a set-up that fails
    releases it before raising."""
    t = cfg.training
    accelerator = _accelerator(cfg, model, plan)
    lease = ensure_process_group(accelerator.device) if (t.fsdp or t.deepspeed) else ProcessGroupLease()
    with released_on_error(lease):
        return _prepared(
            accelerator, model, ref_model, tokenizer, cfg, plan, num_prompts, engine_given, owner, template, lease
        )


def _prepared(
    accelerator,
    model,
    ref_model,
    tokenizer,
    cfg: TrainConfig,
    plan: BatchPlan,
    num_prompts: int,
    engine_given: bool,
    owner,
    template: ChatTemplate | None,
    lease: ProcessGroupLease,
) -> TrainingParts:
    t = cfg.training
    max_steps = total_steps(t, plan, num_prompts)
    zero3 = bool(t.deepspeed) and deepspeed_stage(t.deepspeed) == 3
    ds_config = (
        deepspeed_config(t, model.config.get_text_config().hidden_size, accelerator.num_processes)
        if t.deepspeed
        else None
    )
    whole = generation_copy(model) if (t.fsdp or zero3) and not engine_given else None  # for the in-process engine
    if t.fsdp:  # driven here, not by accelerate (which runs FSDP only on GPUs): one code path for CPU and GPU
        model = shard_model(model, accelerator.device)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters (check --tuner_type/--target_modules)")
    optimizer, scheduler = build_optimizer(optimizers_map.get_or_raise(t.optimizer), params, t, owner, max_steps)
    if t.fsdp:
        prepared, optimizer, scheduler = _prepare_sharded(accelerator, model, optimizer, scheduler)
    elif ds_config is not None:
        prepared, optimizer, scheduler = _prepare_deepspeed(accelerator, model, optimizer, scheduler, ds_config)
    else:
        prepared, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    ref = _reference(accelerator, model, ref_model, cfg, ds_config if zero3 else None)
    # DeepSpeed clips inside the engine's step (gradient_clipping in its config): the loop gets no parameters to clip
    trainable = [] if ds_config else [p for p in prepared.parameters() if p.requires_grad]
    template = template or PromptOptions.from_args(cfg.data, cfg.rollout).template(tokenizer)
    policy = accelerator.unwrap_model(prepared)
    teachers = Teachers.build(cfg, accelerator, prepared, policy, template)
    return TrainingParts(
        accelerator,
        prepared,
        policy,
        optimizer,
        scheduler,
        ref,
        trainable,
        max_steps,
        template,
        whole,
        lease,
        teachers,
    )


def _accelerator(cfg: TrainConfig, model, plan: BatchPlan):
    """accelerate's Accelerator for the options, checked and seeded (seed + rank)."""
    from accelerate import Accelerator  # accelerate loads on first use: `grpokit --help` is fast
    from accelerate.utils import set_seed

    t = cfg.training
    report = installed_trackers(t.report_to)  # a missing one was warned about at start-up (config.moot)
    wants_bf16 = resolve_dtype_name(cfg.model.torch_dtype) == "bfloat16"
    mixed = "bf16" if (wants_bf16 and next(model.parameters()).dtype == torch.float32) else "no"
    accelerator = Accelerator(
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        cpu=use_cpu(t),
        mixed_precision=mixed,
        log_with=report or None,
        project_dir=t.output_dir,
        **accelerate_plugins(t),
        # the loop steps the scheduler once per optimizer step; accelerate would otherwise step it once per
        # process (it assumes a DataLoader sharded over processes), decaying N× too fast under N processes
        step_scheduler_with_optimizer=False,
    )
    check_backend(accelerator, t)
    # the run's one seeding (the pipeline makes the weights under a seed of their own: pipeline.models.seeded_weights)
    set_seed(t.seed, device_specific=True)  # seed + rank: ranks sample different completions
    if plan.prompts_per_rollout % accelerator.num_processes:
        raise ConfigError(
            f"{plan.prompts_per_rollout} prompts per rollout cannot be split over "
            f"{accelerator.num_processes} processes with whole groups; make generation_batch_size / "
            f"num_generations a multiple of {accelerator.num_processes}"
        )
    return accelerator


def _reference(accelerator, model, ref_model, cfg: TrainConfig, ds_config: dict | None):
    """The frozen reference model for the KL term, wrapped like the policy; None with LoRA (adapters disabled are
    the reference) or beta 0."""
    if cfg.algorithm.beta == 0 or is_peft(model):
        return None
    if ref_model is None:
        raise ConfigError("beta != 0 with full fine-tuning needs a reference model (the pipeline loads one)")
    if cfg.training.fsdp:
        ref = shard_model(ref_model, accelerator.device)
    elif ds_config is not None:
        ref = zero_initialize(ref_model.to(accelerator.device), None, ds_config)
    else:
        ref = accelerator.prepare_model(ref_model, evaluation_mode=True)
    ref.eval()  # (DeepSpeed's engine.eval() returns None)
    ref.requires_grad_(False)
    return ref


def _prepare_sharded(accelerator, model, optimizer, scheduler):
    """The FSDP2 model as it is; the optimizer wrapped as accelerate wraps it (it steps only at the end of a
    gradient accumulation) but kept out of accelerate's checkpoint, which would save rank 0's shards only: the
    model and optimizer shards go through torch.distributed.checkpoint instead (sharding.checkpoint_hooks)."""
    from accelerate.optimizer import AcceleratedOptimizer

    checkpoint_hooks(accelerator, model, optimizer)
    return model, AcceleratedOptimizer(optimizer, device_placement=False), accelerator.prepare_scheduler(scheduler)


def _prepare_deepspeed(accelerator, model, optimizer, scheduler, ds_config: dict):
    """A DeepSpeed engine (any stage) over the model and the torch optimizer, in the launcher's process group or
    the run's one-process group; the loop's ``optimizer.step()`` is the engine's step; checkpoints are the
    engine's own (zero.checkpoint_hooks)."""
    engine = zero_initialize(model.to(accelerator.device), optimizer, ds_config)
    checkpoint_hooks_deepspeed(accelerator, engine)
    return engine, EngineStep(engine, optimizer), accelerator.prepare_scheduler(scheduler)


def is_peft(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def total_steps(t, plan: BatchPlan, num_prompts: int) -> int:
    """--max_steps, or the optimizer steps of num_train_epochs over the prompts."""
    if t.max_steps > 0:
        return t.max_steps
    windows = math.ceil(t.num_train_epochs * num_prompts / plan.prompts_per_rollout)
    return max(1, windows * plan.optimizer_steps_per_window)


def setup_rollout(
    engine, scheduler, policy, template, cfg: TrainConfig, accelerator, generation_model=None, images: bool = True
):
    """The engine (the in-process transformers engine over the policy unless one is given; over
    ``generation_model``, a whole copy, when the policy is sharded) and the scheduler that drives it; refuses
    --async_generate with an engine that samples from the live weights.

    Nothing is set on a part after it is built. The engine built here samples on the loop's thread
    (``infer_on_loop_thread``); one given is used as its builder made it (the pipeline builds its engines so).
    ``scheduler``: None (single-turn), a scheduler holding its engine, or a callable ``engine -> scheduler``
    for a scheduler that needs the engine built here (``pipeline.train.scheduler_recipe``). ``images``: whether the
    rows may carry images; the single-turn scheduler built here for a run without them is text-only."""
    if engine is None and generation_model is not None:
        engine = GatheredWeightsEngine(generation_model, template, accelerator.device, **_own_engine(cfg.rollout))
    elif is_zero3(policy) and getattr(engine, "engine_type", "?") not in ("transformers", "server", "vllm"):
        # grpokit's engines gather ZeRO-3 partitions in their weight sync (engines/weights.py); another one would
        # be handed empty partitions
        raise ConfigError(
            f"--deepspeed {cfg.training.deepspeed}: ZeRO-3 with a {engine.engine_type} engine is not "
            "implemented; use the in-process engine, vLLM (--use_vllm true) or server mode"
        )
    engine = engine or TransformersEngine(policy, template, **_own_engine(cfg.rollout))
    check_engine(accelerator, engine)
    if scheduler is None:
        scheduler = RolloutScheduler(engine, text_only=not images)
    elif not isinstance(scheduler, RolloutScheduler) and callable(scheduler):
        scheduler = scheduler(engine)
    if getattr(scheduler, "infer_engine", None) is None:
        raise ConfigError(
            f"the scheduler {type(scheduler).__name__} has no engine: build it with "
            "infer_engine=ENGINE, or pass a callable engine -> scheduler that the trainer calls with "
            "the engine it builds"
        )
    if cfg.rollout.async_generate and engine.engine_type == "transformers":
        raise ConfigError(
            "--async_generate true needs an engine with its own copy of the weights (--vllm_mode "
            "server, or --use_vllm true): the in-process transformers engine samples from the "
            "live training weights, which change while the next window would be generating"
        )
    return engine, scheduler


def _own_engine(r) -> dict:
    """The options of the engine set-up builds: it samples on the loop's thread (our own loop, engines/base.py), and
    its requests carry a constraint only when the run sets one, decided here once."""
    constrained = r.structured_outputs_regex is not None or r.structured_outputs_json is not None
    return {"fast_decode": r.fast_decode, "infer_on_loop_thread": True, "structured_outputs": constrained}


def setup_rewards(funcs, names, weights, scheduler, timeout: float | None = None, distill: bool = False) -> Rewards:
    """One name and weight per reward column; the scheduler's gym reward, if it gives one, is the last.
    ``timeout``: --reward_timeout, seconds one reward function may take on a batch. ``distill``: a teacher is set,
    so no reward at all is pure on-policy distillation (the advantages are the teacher's term alone)."""
    funcs = list(funcs or [])
    names = list(names or [getattr(f, "__name__", type(f).__name__) for f in funcs])
    uses_env_reward = bool(getattr(scheduler, "uses_env_reward", False))
    if uses_env_reward:
        names.append("gym_reward")
    w = list(weights) if weights else [1.0] * len(names)
    if len(w) == len(names) - 1 and uses_env_reward:
        w.append(1.0)
    if len(w) != len(names):
        raise ConfigError(
            f"{len(w)} reward weight(s) for {len(names)} reward(s) ({', '.join(names)}); give one weight each"
        )
    if not names and not distill:
        raise ConfigError("no reward: pass --reward_funcs NAME (e.g. accuracy), --reward_model PATH or a teacher")
    runner = RewardRunner(funcs, names[: len(funcs)], timeout=timeout) if funcs else None
    return Rewards(names, torch.tensor(w, dtype=torch.float32), runner, uses_env_reward)
