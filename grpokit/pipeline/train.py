"""`grpokit train`: assemble data, models, rewards, scheduler and engine; pick the trainer; run."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from accelerate.utils import set_seed

from grpokit.agents import agents
from grpokit.agents.scheduler import AgentScheduler, check_agent_options
from grpokit.agents.verifiers_env import (
    VerifiersScheduler,
    check_verifiers_options,
    env_tasks,
    load_verifiers_env,
    rubric_columns,
    write_task_rows,
)
from grpokit.config.args import TrainConfig
from grpokit.config.plan import batch_plan
from grpokit.config.resolve import resolve
from grpokit.config.validate import check_registry_names
from grpokit.data.columns import parse_columns
from grpokit.data.loading import RowOptions, load_train_val, resolve_system
from grpokit.engines.client import RolloutClient
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.engines.vllm_engine import VllmEngine
from grpokit.modeling import load_causal_lm, load_tokenizer, torch_dtype
from grpokit.pipeline.models import bound_prompt_length, load_policy, resolve_model_path
from grpokit.pipeline.vlm_parts import check_model_takes_images
from grpokit.plugins.loader import load_plugins_once
from grpokit.rewards import build_reward_funcs, check_reward_columns
from grpokit.rewards.rm_plugin import RewardModelReward, make_rm_plugin, rm_plugins
from grpokit.rollout.multi_turn import build_scheduler as build_multi_turn
from grpokit.rollout.multi_turn import multi_turns
from grpokit.rollout.remote import RemoteScheduler, check_server_template, trainer_plays_turns
from grpokit.server.openai_routes import LocalEndpoint
from grpokit.template.encode import ChatTemplate
from grpokit.template.prompts import PromptOptions, prepare_prompts
from grpokit.trainers.callbacks import callbacks_map
from grpokit.trainers.chord_sft import load_chord_sft_dataset
from grpokit.trainers.factory import TrainerFactory
from grpokit.trainers.optimizers import optimizers_map
from grpokit.trainers.run_args import preflight_resume
from grpokit.trainers.run_dir import RunLock, prepare_output_dir
from grpokit.trainers.signals import stop_outside_the_loop
from grpokit.trainers.zero import release_process_group

logger = logging.getLogger("grpokit")


def build_rewards(cfg: TrainConfig, tokenizer, columns: set[str], env_reward: bool = False):
    """Reward functions, then reward models (each through its rm_plugin); checked against dataset columns.
    ``env_reward``: the scheduler's gym reward is a reward, so no function is needed by default."""

    default = [] if (cfg.reward.reward_model or env_reward) else ["accuracy"]
    names = list(cfg.reward.reward_funcs or default)
    options = cfg.flat()
    funcs = build_reward_funcs(names, options, tokenizer)
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


def build_scheduler(cfg: TrainConfig, tokenizer, verifiers: tuple | None = None):
    """``verifiers``: (env, tasks) of --verifiers_env, loaded once before the dataset (its tasks are the rows)."""
    if verifiers is not None:
        return VerifiersScheduler.from_env(*verifiers, cfg.rollout, serve=LocalEndpoint)
    if cfg.rollout.agent:  # episodes against a local OpenAI-compatible endpoint over the trainer's engine
        return AgentScheduler.from_args(cfg.rollout, serve=LocalEndpoint)
    if not cfg.rollout.multi_turn_scheduler:
        return None
    scheduler = build_multi_turn(cfg.rollout, tokenizer)
    if cfg.rollout.use_gym_env is not None:  # explicit, as in ms-swift: total_reward is (not) a reward
        scheduler.uses_env_reward = cfg.rollout.use_gym_env
    return scheduler


def build_engine(cfg: TrainConfig):
    """None means: the trainer's default in-process TransformersEngine on the live weights."""
    r = cfg.rollout
    if r.vllm_mode == "server" and (r.vllm_server_host or r.vllm_server_base_url):
        return RolloutClient.from_args(r)
    if r.use_vllm:  # colocate: vLLM in this process, loaded from the policy's folder, weights synced in place
        engine = VllmEngine.from_rollout_args(r, resolve_model_path(cfg.model), cfg.model.torch_dtype,
                                              seed=cfg.training.seed)
        engine.template = PromptOptions.from_args(cfg.data, r).template(engine.tokenizer)  # as the trainer renders
        return engine
    return None


def run_train(cfg: TrainConfig):
    cfg = resolve(cfg)  # a no-op on a parsed configuration; fills a TrainConfig built in code the same way
    load_plugins_once(cfg.reward.external_plugins)  # the one load, before any registry lookup
    check_registry_names(cfg)  # the option values that name what a plugin may register, before any model loads
    check_names(cfg)
    plan = batch_plan(cfg)
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
        with stop_outside_the_loop():  # the loop itself saves on SIGTERM (trainers/signals.py)
            return _run_train(cfg, log)
    finally:
        lock.release()


def _run_train(cfg: TrainConfig, log):
    d = cfg.data
    rows = RowOptions(columns=parse_columns(d.columns), num_proc=d.dataset_num_proc,
                      load_from_cache_file=d.load_from_cache_file, max_row_bytes=d.max_row_bytes)
    verifiers = None
    if cfg.rollout.verifiers_env:  # the environment's tasks are the rows unless --dataset gives its own
        env = load_verifiers_env(cfg.rollout.verifiers_env)
        verifiers = (env, env_tasks(env))
    default = [write_task_rows(verifiers[1], cfg.training.output_dir)] if verifiers else ["builtin:arithmetic"]
    train_ds, val_ds = load_train_val(d.dataset or default, d.val_dataset,
                                      system=resolve_system(d.system), seed=cfg.training.seed,
                                      split_dataset_ratio=d.split_dataset_ratio, options=rows)
    set_seed(cfg.training.seed)  # before any weights are made: the LoRA init is the same on every rank and run
    model, tokenizer, ref = load_policy(cfg.model, cfg.algorithm.beta, log=log)
    bound = bound_prompt_length(model, d, cfg.rollout.max_completion_length, resolve_model_path(cfg.model), log)
    check_model_takes_images(train_ds, tokenizer, resolve_model_path(cfg.model, log=log), cfg.rollout)
    # tools and template kwargs into the prompts, then the prompt bound (--max_length, or the context's room)
    prompts = PromptOptions.from_args(replace(d, max_length=bound), cfg.rollout)
    train_ds = prepare_prompts(train_ds, prompts.template(tokenizer), prompts, "--dataset")
    if val_ds is not None:
        val_ds = prepare_prompts(val_ds, prompts.template(tokenizer), prompts, "--val_dataset")
    chord_sft = load_chord_sft_dataset(cfg, tokenizer) if cfg.algorithm.chord_sft_dataset else None  # CHORD
    engine = build_engine(cfg)
    if engine is not None and getattr(engine, "engine_type", "") == "server":
        check_server_template(prompts.chat_template_kwargs.get("enable_thinking"), engine.engine_info())
        if trainer_plays_turns(cfg.rollout, engine.engine_info()):  # single-turn server: each turn one request
            scheduler = build_scheduler(cfg, tokenizer)
            scheduler.infer_engine = engine
        else:
            scheduler = RemoteScheduler.from_args(engine, cfg.rollout,  # multi-turn runs inside the server
                                                  template=prompts.template(tokenizer))
    else:
        scheduler = build_scheduler(cfg, tokenizer, verifiers)
    env_reward = bool(getattr(scheduler, "uses_env_reward", False))
    funcs, names = build_rewards(cfg, tokenizer, set(train_ds.column_names), env_reward)
    funcs, names, weights = rubric_columns(scheduler, funcs, names, cfg.reward.reward_weights or None)
    for func in funcs:  # a reward that vets the rows before training (code_exec: tests it cannot grade)
        if callable(getattr(func, "check_rows", None)):
            func.check_rows(train_ds)
    callbacks = [callbacks_map.get_or_raise(n) for n in cfg.training.callbacks]  # built by the trainer
    trainer_cls = TrainerFactory.get_trainer_cls("grpo")
    try:
        trainer = trainer_cls(model=model, tokenizer=tokenizer, cfg=cfg, train_dataset=train_ds,
                              eval_dataset=val_ds, reward_funcs=funcs, reward_names=names,
                              reward_weights=weights, ref_model=ref, scheduler=scheduler,
                              engine=engine, callbacks=callbacks,
                              # only when given: a plugin's trainer class without this argument keeps working
                              **({"chord_sft_dataset": chord_sft} if chord_sft is not None else {}))
    except BaseException:
        release_process_group()  # a set-up that failed after forming a one-process group (train() releases its own)
        raise
    trainer.train()
    return trainer
