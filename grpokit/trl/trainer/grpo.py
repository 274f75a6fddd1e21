"""TRL's ``GRPOTrainer(model, reward_funcs, args, train_dataset, ...)`` over grpokit's pipeline: the model folder,
reward callables and a ``datasets.Dataset`` become grpokit's trainer (the one ``TrainerFactory`` names), and
``train()`` runs grpokit's loop."""

from __future__ import annotations

from typing import Any

from grpokit.errors import ConfigError
from grpokit.trl.config import GRPOConfig


class GRPOTrainer:
    """``GRPOTrainer(model=<local folder or hub id>, reward_funcs=f or [f, ...], args=GRPOConfig(...),
    train_dataset=datasets.Dataset, eval_dataset=None, callbacks=None)``; ``train()`` returns the trainer state and
    ``trainer`` is grpokit's GRPOTrainer once built. Arguments grpokit does not take are refused by name."""

    def __init__(
        self,
        model: Any,
        reward_funcs: Any,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        peft_config: Any = None,
    ) -> None:
        if not isinstance(model, str):
            raise ConfigError(
                f"GRPOTrainer(model=<{type(model).__name__}>): give the model's folder or hub id as a "
                "string; grpokit loads it (and its reference copy) itself"
            )
        for name, value, fix in (
            ("processing_class", processing_class, "the model folder's tokenizer is used"),
            (
                "reward_processing_classes",
                reward_processing_classes,
                "reward models are given as --reward_model in GRPOConfig(reward_model=[...])",
            ),
            (
                "peft_config",
                peft_config,
                "use GRPOConfig(tuner_type='lora', lora_rank=..., lora_alpha=..., target_modules=[...])",
            ),
        ):
            if value is not None:
                raise ConfigError(f"GRPOTrainer({name}=...): not supported by grpokit; {fix}")
        if optimizers != (None, None):
            raise ConfigError(
                "GRPOTrainer(optimizers=...): not supported by grpokit; register a builder or an "
                "OptimizerCallback in optimizers_map and give GRPOConfig(optimizer=NAME)"
            )
        if train_dataset is None or not hasattr(train_dataset, "column_names") or not hasattr(train_dataset, "__len__"):
            raise ConfigError(
                f"GRPOTrainer(train_dataset=<{type(train_dataset).__name__}>): give a datasets.Dataset "
                "(an IterableDataset is not supported)"
            )
        funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs or not all(callable(f) or isinstance(f, str) for f in funcs):
            raise ConfigError(
                "GRPOTrainer(reward_funcs=...): give a function, a registered reward name, or a list of them"
            )
        self.model_path, self.reward_funcs = model, list(funcs)
        self.args = args or GRPOConfig(output_dir="output")
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.callbacks = list(callbacks or [])
        self.trainer = None

    def train(self):
        self.trainer = build_trainer(self)
        return self.trainer.train()


def build_trainer(spec: GRPOTrainer):
    """grpokit's trainer for a TRL-shaped call: options parsed and checked by grpokit's parser, prompts prepared
    as ``grpokit train`` prepares them."""
    # imported here, not at the top: `from grpokit.trl import GRPOConfig` stays light (no model, data or engine
    # code) until a trainer is built
    from grpokit.config.parse import parse_train_args
    from grpokit.data.rows import normalize_rows
    from grpokit.pipeline.models import load_policy, seeded_weights
    from grpokit.pipeline.train import build_engine
    from grpokit.rewards import build_reward_funcs, check_reward_columns, reward_name
    from grpokit.template.prompts import PromptOptions, prepare_prompts
    from grpokit.trainers.factory import TrainerFactory

    # TRL trains the whole model unless given a LoRA config: full unless GRPOConfig(tuner_type='lora') says so
    flags = ["--model", spec.model_path, "--tuner_type", "full", *spec.args.flags()]
    cfg = parse_train_args(flags, prog="grpokit.trl.GRPOTrainer")
    train = normalize_rows(spec.train_dataset, cfg.data.system, source="train_dataset")
    val = (
        None if spec.eval_dataset is None else normalize_rows(spec.eval_dataset, cfg.data.system, source="eval_dataset")
    )
    with seeded_weights(cfg.training.seed):  # the LoRA init from the seed, as grpokit train makes it
        model, tokenizer, ref = load_policy(cfg.model, cfg.algorithm.beta, log=lambda *a, **k: None)
    prompts = PromptOptions.from_args(cfg.data, cfg.rollout)
    template = prompts.template(tokenizer)
    train = prepare_prompts(train, template, prompts, "train_dataset")
    if val is not None:
        val = prepare_prompts(val, template, prompts, "eval_dataset")
    funcs = build_reward_funcs(spec.reward_funcs, cfg.flat(), tokenizer)
    names = [f if isinstance(f, str) else reward_name(f) for f in spec.reward_funcs]
    check_reward_columns(funcs, names, set(train.column_names))
    return TrainerFactory.get_trainer_cls("grpo")(
        model=model,
        tokenizer=tokenizer,
        cfg=cfg,
        train_dataset=train,
        eval_dataset=val,
        reward_funcs=funcs,
        reward_names=names,
        reward_weights=cfg.reward.reward_weights or None,
        ref_model=ref,
        engine=build_engine(cfg, template),
        callbacks=spec.callbacks,
        template=template,
    )  # one template
