"""`grpokit train`: assemble data, models, rewards, scheduler and engine; pick the trainer; run.

Each part is built once, from the options, and handed to the parts that use it (torchtune's recipe ``setup()``):
the batch plan, the chat template (the prompts' rendering, the engine's, the scheduler's, the trainer's and
CHORD's are one object), the engine and the scheduler, which get everything as constructor arguments; nothing is
set on a part after it is built. A multi-turn scheduler for the trainer's own in-process engine is handed over as
a recipe (``scheduler_recipe``): that engine exists only once the trainer has prepared the policy.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from dataclasses import replace

from grpokit.agents import agents
from grpokit.agents.scheduler import AgentScheduler, check_agent_options
from grpokit.agents.verifiers_env import (
    VerifiersScheduler,
    check_verifiers_options,
    env_tasks,
    load_verifiers_env,
    reward_names,
    rubric_columns,
    write_task_rows,
)
from grpokit.config.args import TrainConfig
from grpokit.config.checked import checked_config
from grpokit.config.plan import batch_plan
from grpokit.config.teacher_args import TEACHER_PROMPT, teacher_specs
from grpokit.config.validate import check_registry_names
from grpokit.data.columns import parse_columns
from grpokit.data.loading import RowOptions, load_train_val, resolve_system
from grpokit.data.rows import normalize_rows
from grpokit.engines.adapters import AdapterSync
from grpokit.engines.partial.vllm_steps import PausableVllmEngine
from grpokit.engines.swift_client import connect
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.engines.vllm_engine import VllmEngine
from grpokit.errors import ConfigError
from grpokit.modeling import load_causal_lm, load_tokenizer, torch_dtype
from grpokit.pipeline.models import (
    bound_prompt_length,
    check_tokenizer_covers,
    load_policy,
    resolve_model_path,
    seeded_weights,
)
from grpokit.pipeline.plan_time import warn_if_slow
from grpokit.pipeline.supplied import Supplied, padded, supplied_policy
from grpokit.pipeline.vlm_parts import check_model_takes_images
from grpokit.plugins.loader import load_plugins_once
from grpokit.rewards import build_reward_funcs, check_reward_columns
from grpokit.rewards.descendants import reap_descendants
from grpokit.rewards.rm_plugin import RewardModelReward, make_rm_plugin, rm_plugins
from grpokit.rollout.multi_turn import build_scheduler as build_multi_turn
from grpokit.rollout.multi_turn import multi_turns
from grpokit.rollout.remote import RemoteScheduler, check_server_template, trainer_plays_turns
from grpokit.rollout.scheduler import RolloutScheduler
from grpokit.runs.run_args import preflight_resume
from grpokit.runs.run_dir import RunLock, prepare_output_dir
from grpokit.runs.stops import stop_outside_the_loop
from grpokit.server.openai_routes import LocalEndpoint
from grpokit.template.encode import ChatTemplate
from grpokit.template.prompts import PromptOptions, prepare_prompts
from grpokit.trainers.callbacks import callbacks_map
from grpokit.trainers.chord_sft import load_chord_sft_dataset
from grpokit.trainers.factory import TrainerFactory
from grpokit.trainers.optimizers import optimizers_map

logger = logging.getLogger("grpokit")


def build_rewards(
    cfg: TrainConfig, tokenizer, columns: set[str], env_reward: bool = False, supplied: list[tuple[str, object]] = ()
):
    """Reward functions, the caller's (``supplied``: name, callable), then reward models (each through its
    rm_plugin); checked against dataset columns. ``env_reward``: the scheduler's gym reward is a reward, so no
    function is needed by default."""

    teacher = teacher_specs(cfg.teacher, cfg.model.model, cfg.model.tuner_type == "lora")  # pure distillation
    if TEACHER_PROMPT in columns and not teacher:  # ms-swift: the current policy as its own teacher
        raise ConfigError(
            f"the dataset has a {TEACHER_PROMPT} column but no --teacher_model/--teacher_model_server; "
            "self-distillation with the current policy as teacher is not implemented: name a teacher "
            "(the --model folder itself is a frozen copy of the start) or drop the column"
        )
    default = [] if (cfg.reward.reward_model or env_reward or supplied or teacher) else ["accuracy"]
    names = list(cfg.reward.reward_funcs or default)
    funcs = build_reward_funcs(names, cfg.flat(), tokenizer)
    funcs += [func for _, func in supplied]
    names += [name for name, _ in supplied]
    check_reward_columns(funcs, names, columns)
    plugins = cfg.reward.reward_model_plugin or ["default"] * len(cfg.reward.reward_model)
    for path, plugin_name in zip(cfg.reward.reward_model, plugins, strict=True):
        plugin_cls = rm_plugins.get_or_raise(plugin_name)
        if plugin_name == "genrm":  # a generative judge: a causal LM behind its own engine
            plugin = plugin_cls(_judge_engine(path, cfg.model.torch_dtype), None)
        else:
            plugin = make_rm_plugin(plugin_cls, path, cfg.model.torch_dtype)  # ms-swift: (model, template)
        name = f"rm_{os.path.basename(os.path.normpath(path))}"
        funcs.append(RewardModelReward(plugin, name))
        names.append(name)
    return funcs, names


def _judge_engine(path: str, dtype_name: str):
    model = load_causal_lm(path, torch_dtype(dtype_name, for_training_weights=False))
    model.requires_grad_(False).eval()
    return TransformersEngine(model, ChatTemplate(load_tokenizer(path)))


def check_names(cfg: TrainConfig) -> None:
    """Registry names that plugins may add, checked right after the plugins load (before any model loads)."""
    optimizers_map.get_or_raise(cfg.training.optimizer)
    for name in cfg.training.callbacks:
        callbacks_map.get_or_raise(name)
    for name in cfg.reward.reward_model_plugin:
        rm_plugins.get_or_raise(name)
    if cfg.rollout.multi_turn_scheduler and cfg.rollout.vllm_mode != "server":
        multi_turns.get_or_raise(cfg.rollout.multi_turn_scheduler)
    if cfg.rollout.agent:
        check_agent_options(cfg.rollout)
        agents.get_or_raise(cfg.rollout.agent)
    check_verifiers_options(cfg.rollout)
    TrainerFactory.get_trainer_cls("grpo")


def scheduler_recipe(cfg: TrainConfig, tokenizer, template: ChatTemplate, verifiers: tuple | None = None):
    """``engine -> scheduler`` for ``--multi_turn_scheduler``, ``--agent`` and ``--verifiers_env`` (None without
    one), rendering with the run's template; --use_gym_env, when given, is the explicit choice whether total_reward
    is a reward (as in ms-swift). ``verifiers``: (env, tasks) of --verifiers_env, loaded once before the dataset
    (its tasks are the rows). An agent's episodes run against a local OpenAI-compatible endpoint over the engine."""
    if verifiers is not None:
        return functools.partial(VerifiersScheduler.from_env, *verifiers, cfg.rollout, LocalEndpoint)
    if cfg.rollout.agent:
        return functools.partial(AgentScheduler.from_args, cfg.rollout, LocalEndpoint)
    if not cfg.rollout.multi_turn_scheduler:
        return None
    return functools.partial(
        build_multi_turn, cfg.rollout, tokenizer, template=template, uses_env_reward=cfg.rollout.use_gym_env
    )


def uses_env_reward(cfg: TrainConfig, scheduler) -> bool:
    """Whether the scheduler's gym reward is a reward column: a built scheduler says; for a recipe, --use_gym_env
    or the scheduler class's own ``uses_env_reward``."""
    if scheduler is None or isinstance(scheduler, RolloutScheduler):
        return bool(getattr(scheduler, "uses_env_reward", False))
    if cfg.rollout.agent or cfg.rollout.verifiers_env:  # the episode's reward is the gym_reward column
        return AgentScheduler.uses_env_reward
    if cfg.rollout.use_gym_env is not None:
        return cfg.rollout.use_gym_env
    if not cfg.rollout.multi_turn_scheduler:  # a caller's recipe (the TRL API's tool loop) scores no gym reward
        return False
    default = getattr(multi_turns.get_or_raise(cfg.rollout.multi_turn_scheduler), "uses_env_reward", False)
    return default if isinstance(default, bool) else False  # a property is the instance's to answer


def build_engine(cfg: TrainConfig, template: ChatTemplate):
    """None means: the trainer's default in-process TransformersEngine on the live weights. The engines built here
    sample on the trainer's loop thread (``infer_on_loop_thread``: the trainer owns its rollout loop)."""
    r = cfg.rollout
    if r.vllm_mode == "server" and (r.vllm_server_host or r.vllm_server_base_url):
        return connect(r, infer_on_loop_thread=True)  # grpokit's protocol, or ms-swift's (engines/swift_client.py)
    if r.use_vllm:  # colocate: vLLM in this process, loaded from the policy's folder, weights synced in place
        engine = PausableVllmEngine if r.partial_rollouts else VllmEngine  # a sync pauses and continues its batch
        lora = None  # adapter-only syncs as LoRA versions (engines/vllm_adapters.py); None: merged
        if r.vllm_enable_lora and cfg.model.tuner_type == "lora" and r.partial_rollouts:
            logger.warning("--vllm_enable_lora: vLLM colocate syncs merged weights with --partial_rollouts true")
        elif r.vllm_enable_lora and cfg.model.tuner_type == "lora":
            lora = AdapterSync.for_run(r, "vLLM colocate")
        return engine.from_rollout_args(
            r,
            resolve_model_path(cfg.model),
            cfg.model.torch_dtype,
            seed=cfg.training.seed,
            template=template,  # as the trainer renders
            infer_on_loop_thread=True,
            lora=lora,
        )
    return None


def run_train(cfg: TrainConfig, supplied: Supplied | None = None):
    """``grpokit train``: the assembled trainer, trained; returns it."""
    with assembled(cfg, supplied) as trainer:
        trainer.train()
        return trainer


@contextlib.contextmanager
def assembled(cfg: TrainConfig, supplied: Supplied | None = None):
    """The one assembly, for every way in (flags, YAML, the TRL API, a TrainConfig built in code): the options
    checked (bounds, the rules between options), the plugins loaded and the names they may register checked, the
    run folder probed and locked, a resume checked, then the parts built (``supplied`` ones used as given) into a
    ready trainer, yielded while the lock is held."""
    supplied = supplied or Supplied()
    cfg = checked_config(cfg, len(supplied.rewards), supplied.eval_dataset is not None)  # no-op on a parsed one
    load_plugins_once(cfg.reward.external_plugins)  # the one load, before any registry lookup
    check_registry_names(cfg)  # the option values that name what a plugin may register, before any model loads
    check_names(cfg)
    plan = batch_plan(cfg)  # the run's one plan, handed to the trainer
    rank0 = int(os.environ.get("RANK", "0")) == 0
    log = print if rank0 else (lambda *a, **k: None)
    log(plan.describe(), flush=True)
    # the run folder before anything heavy loads: writable (a probe file), this run's alone (a lock), and the
    # checkpoint a resume names whole and trained with the same options
    t = cfg.training
    prepare_output_dir(t.output_dir)
    lock = RunLock(t.output_dir)
    if rank0:
        lock.acquire()
    try:
        preflight_resume(t.output_dir, t.resume_from_checkpoint, cfg.flat())
        # the loop itself saves on SIGTERM (runs/stops.py); what rewards and agents start ends with the run
        with stop_outside_the_loop(), reap_descendants():
            yield _build(cfg, plan, log, supplied)
    finally:
        lock.release()


def _takes(trainer_cls, **parts) -> dict:
    """The set-up's parts that ``trainer_cls.__init__`` takes: a plugin's trainer written with the older signature
    (no ``template``/``plan``, no ``**kwargs``) makes its own from the options, as a trainer built in code does."""
    params = inspect.signature(trainer_cls.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return parts
    names = {p.name for p in params}
    return {k: v for k, v in parts.items() if k in names}


def _datasets(cfg: TrainConfig, supplied: Supplied, verifiers: tuple | None):
    """(train, val) rows: the caller's datasets, else --dataset/--val_dataset (a --verifiers_env's tasks, or the
    built-in arithmetic, when neither names one)."""
    d = cfg.data
    if supplied.train_dataset is not None:
        system = resolve_system(d.system)
        val = supplied.eval_dataset
        return (
            normalize_rows(supplied.train_dataset, system, source="train_dataset"),
            None if val is None else normalize_rows(val, system, source="eval_dataset"),
        )
    rows = RowOptions(
        columns=parse_columns(d.columns),
        num_proc=d.dataset_num_proc,
        load_from_cache_file=d.load_from_cache_file,
        max_row_bytes=d.max_row_bytes,
    )
    default = [write_task_rows(verifiers[1], cfg.training.output_dir)] if verifiers else ["builtin:arithmetic"]
    return load_train_val(
        d.dataset or default,
        d.val_dataset,
        system=resolve_system(d.system),
        seed=cfg.training.seed,
        split_dataset_ratio=d.split_dataset_ratio,
        options=rows,
    )


def _policy(cfg: TrainConfig, supplied: Supplied, log):
    """(policy, tokenizer, ref): the caller's model object, else --model loaded; LoRA from the seed either way."""
    with seeded_weights(cfg.training.seed):  # the LoRA init is the same on every rank and run
        if supplied.model is not None:
            return supplied_policy(
                supplied.model, supplied.tokenizer, cfg.model, cfg.algorithm.beta, supplied.peft_config
            )
        model, tokenizer, ref = load_policy(cfg.model, cfg.algorithm.beta, log=log, peft_config=supplied.peft_config)
    if supplied.tokenizer is not None:  # the caller's tokenizer (TRL's processing_class) for the folder's model
        check_tokenizer_covers(model, supplied.tokenizer, resolve_model_path(cfg.model))
        tokenizer = padded(supplied.tokenizer)
    return model, tokenizer, ref


def _build(cfg: TrainConfig, plan, log, supplied: Supplied):  # long on purpose: the set-up's order, read top down
    verifiers = None
    if cfg.rollout.verifiers_env:  # the environment's tasks are the rows unless --dataset gives its own
        env = load_verifiers_env(cfg.rollout.verifiers_env)
        verifiers = (env, env_tasks(env))
    train_ds, val_ds = _datasets(cfg, supplied, verifiers)
    model, tokenizer, ref = _policy(cfg, supplied, log)
    warn_if_slow(model, cfg, plan, log)  # a plan of minutes a step on this CPU is said before it starts
    d = cfg.data
    bound = bound_prompt_length(model, d, cfg.rollout.max_completion_length, resolve_model_path(cfg.model), log)
    check_model_takes_images(train_ds, tokenizer, resolve_model_path(cfg.model, log=log), cfg.rollout)
    # tools and template kwargs into the prompts, then the prompt bound (--max_length, or the context's room)
    prompts = PromptOptions.from_args(replace(d, max_length=bound), cfg.rollout)
    template = prompts.template(tokenizer)  # the one chat template of the run: prompts, engine, scheduler, trainer
    where = ("train_dataset", "eval_dataset") if supplied.train_dataset is not None else ("--dataset", "--val_dataset")
    train_ds = prepare_prompts(train_ds, template, prompts, where[0])
    if val_ds is not None:
        val_ds = prepare_prompts(val_ds, template, prompts, where[1])
    chord_sft = (
        load_chord_sft_dataset(cfg, tokenizer, template)  # CHORD
        if cfg.algorithm.chord_sft_dataset
        else None
    )
    engine = build_engine(cfg, template)
    scheduler = supplied.scheduler or scheduler_recipe(cfg, tokenizer, template, verifiers)
    if engine is not None and getattr(engine, "engine_type", "") == "server":
        check_server_template(prompts.chat_template_kwargs.get("enable_thinking"), engine.engine_info())
        if not trainer_plays_turns(cfg.rollout, engine.engine_info()):  # multi-turn runs inside the server
            scheduler = RemoteScheduler.from_args(engine, cfg.rollout, template=template)
    if engine is not None and scheduler is not None and not isinstance(scheduler, RolloutScheduler):
        scheduler = scheduler(engine)  # a single-turn server plays each turn as one request; or vLLM colocate
    env_reward = uses_env_reward(cfg, scheduler)
    funcs, names = build_rewards(cfg, tokenizer, set(train_ds.column_names), env_reward, supplied.rewards)
    funcs, names, weights = rubric_columns(
        reward_names(verifiers[1]) if verifiers else None, funcs, names, cfg.reward.reward_weights or None
    )
    for func in funcs:  # a reward that vets the rows before training (code_exec: tests it cannot grade)
        if callable(getattr(func, "check_rows", None)):
            func.check_rows(train_ds)
    # named callbacks are built by the trainer; the caller's objects are used as they are
    callbacks = [callbacks_map.get_or_raise(n) for n in cfg.training.callbacks] + list(supplied.callbacks)
    trainer_cls = TrainerFactory.get_trainer_cls("grpo")
    # (a one-process group the set-up forms is the trainer's: released at its end, or when its set-up fails)
    return trainer_cls(
        model=model,
        tokenizer=tokenizer,
        cfg=cfg,
        train_dataset=train_ds,
        eval_dataset=val_ds,
        reward_funcs=funcs,
        reward_names=names,
        reward_weights=weights,
        ref_model=ref,
        scheduler=scheduler,
        engine=engine,
        callbacks=callbacks,
        **_takes(trainer_cls, template=template, plan=plan),
        # only when given: a plugin's trainer class without this argument keeps working
        **({"chord_sft_dataset": chord_sft} if chord_sft is not None else {}),
    )
