"""TRL's ``GRPOTrainer`` over grpokit's one assembly (``grpokit.pipeline.train.assembled``): the arguments become a
checked configuration and the parts a caller may hand over (``Supplied``), and ``train()`` runs the same set-up as
``grpokit train``: the option checks, the run-folder lock, the resume check, the prompt bound, the rewards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpokit.config.parse import parse_train_args
from grpokit.config.plan import checkpoint_dirs
from grpokit.distributed.processes import full_state_dict
from grpokit.errors import ConfigError
from grpokit.pipeline.supplied import Supplied, model_folder
from grpokit.pipeline.train import assembled
from grpokit.redaction import redacting_logs, remember_secrets
from grpokit.trl.agent import rollout_parts, with_tools
from grpokit.trl.config import GRPOConfig
from grpokit.trl.reward_setup import reward_list


class GRPOTrainer:
    """``GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
    reward_processing_classes, callbacks, optimizers, peft_config, tools, rollout_func, environment_factory)`` as in
    TRL 1.16. The model and rewards load when ``train()`` starts, under the run folder's lock; until then
    ``trainer`` (grpokit's trainer) is None."""

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list | None = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
    ) -> None:
        _check_arguments(optimizers, quantization_config, train_dataset, eval_dataset)
        path = model if isinstance(model, (str, Path)) else model_folder(model)
        self.args = args if args is not None else GRPOConfig(output_dir=f"{Path(str(path)).name}-GRPO")
        lora = peft_config is not None or hasattr(model, "peft_config")
        rewards = reward_list(reward_funcs, reward_processing_classes, self.args.reward_model_dtype())
        # checkpoints of an earlier run are fine until train() says whether it resumes them: checked there
        later = ["--resume_from_checkpoint", "latest"] if checkpoint_dirs(self.args.output_dir) else []
        flags = ["--model", str(path), *self.args.flags(lora=lora), *_lora_flags(peft_config), *later]
        cfg = _parsed(flags, self.args, len(rewards), eval_dataset is not None)
        cfg.training.resume_from_checkpoint = None  # train(resume_from_checkpoint=...) decides
        given = len(rewards)
        scheduler, rewards, schemas = rollout_parts(
            cfg, tools, environment_factory, rollout_func, self.args, self, rewards
        )
        if not rewards:
            raise ConfigError(
                "GRPOTrainer(reward_funcs=None): give a reward function (or an environment_factory "
                "whose environments define get_reward)"
            )
        if cfg.reward.reward_weights:  # as TRL: an environment's get_reward column weighs 1
            cfg.reward.reward_weights = [*cfg.reward.reward_weights, *[1.0] * (len(rewards) - given)]
        if schemas is not None:  # the tools into every prompt, through the chat template
            train_dataset = with_tools(train_dataset, schemas, "train_dataset")
            eval_dataset = None if eval_dataset is None else with_tools(eval_dataset, schemas, "eval_dataset")
        self.supplied = Supplied(
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            model=None if isinstance(model, (str, Path)) else model,
            tokenizer=processing_class,
            peft_config=peft_config,
            rewards=rewards,
            callbacks=list(callbacks or []),
            scheduler=scheduler,
        )
        self.cfg = cfg  # checked by the parser (as TRL fails at construction); train() checks what changed since
        self.reward_funcs = [func for _, func in rewards]
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class = processing_class
        self.trainer = None

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        """Train; returns transformers' ``TrainOutput(global_step, training_loss, metrics)``. ``True`` resumes
        from the last checkpoint in output_dir, a path from that checkpoint."""
        if kwargs:
            raise ConfigError(
                f"GRPOTrainer.train({next(iter(kwargs))}=...): not supported; train() takes resume_from_checkpoint"
            )
        cfg = self.cfg
        if resume_from_checkpoint:
            cfg.training.resume_from_checkpoint = (
                "latest" if resume_from_checkpoint is True else str(resume_from_checkpoint)
            )
        with redacting_logs(), assembled(cfg, self.supplied) as trainer:  # no key or token in a log line
            self.trainer = trainer
            state = trainer.train()
        from transformers.trainer_utils import TrainOutput  # not at the top: transformers loads with the run

        losses = [row["loss"] for row in state.log_history if "loss" in row]
        return TrainOutput(state.global_step, sum(losses) / len(losses) if losses else 0.0, dict(state.last_logs))

    def _built(self, what: str):
        if self.trainer is None:
            raise ConfigError(f"GRPOTrainer.{what}: the model is built when train() starts; call train() first")
        return self.trainer

    @property
    def model(self):
        return self._built("model").model

    @property
    def state(self):
        return self._built("state").state

    def __getattr__(self, name: str):
        """Other attributes of a TRL trainer (``accelerator``, ``optimizer``, ``lr_scheduler``, ...): grpokit's
        trainer's, once train() has built it."""
        if name.startswith("_") or "trainer" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self._built(name), name)

    def push_to_hub(self, *args: Any, **kwargs: Any) -> None:
        raise ConfigError(
            "GRPOTrainer.push_to_hub(): not supported by grpokit; save_model() and upload the folder "
            "(huggingface-cli upload)"
        )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The trained model (the adapter, under LoRA) and its tokenizer into ``output_dir`` (default: the run's)."""
        trainer = self._built("save_model()")
        out = Path(output_dir or self.args.output_dir)
        acc = trainer.accelerator
        state_dict = full_state_dict(acc, trainer.model)
        if acc.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
            acc.unwrap_model(trainer.model).save_pretrained(out, state_dict=state_dict, safe_serialization=True)
            trainer.tokenizer.save_pretrained(out)
        acc.wait_for_everyone()

    def evaluate(self, eval_dataset: Any = None, **kwargs: Any) -> dict:
        """Completions on the evaluation set scored by the rewards; keys as TRL's (``eval_`` + the metric)."""
        if eval_dataset is not None or kwargs:
            raise ConfigError("GRPOTrainer.evaluate(...): give the evaluation set as GRPOTrainer(eval_dataset=...)")
        trainer = self._built("evaluate()")
        if trainer.eval_dataset is None:
            raise ConfigError("GRPOTrainer.evaluate(): no eval_dataset was given")
        logs = trainer.evaluate()
        return {("eval_" + k.removeprefix("eval/")): v for k, v in logs.items() if k.startswith("eval/")}


def _parsed(flags: list[str], args: GRPOConfig, rewards: int, has_eval: bool):
    """The run's checked configuration; its keys and tokens stay out of every log line, parsing's included."""
    remember_secrets(args.to_dict())
    with redacting_logs():
        return parse_train_args(flags, prog="GRPOTrainer", supplied_rewards=rewards, supplied_eval=has_eval)


def _check_arguments(optimizers: Any, quantization_config: Any, train_dataset: Any, eval_dataset: Any) -> None:
    """The arguments grpokit does not take, refused by name."""
    if optimizers not in ((None, None), None):
        raise ConfigError(
            "GRPOTrainer(optimizers=...): not supported by grpokit; pick one with "
            "GRPOConfig(optim=...), or register a builder in optimizers_map and give "
            "GRPOConfig(optimizer=NAME)"
        )
    if quantization_config is not None:
        raise ConfigError(
            "GRPOTrainer(quantization_config=...): quantized training (QLoRA) is not supported by "
            "grpokit; use peft_config on the unquantized model"
        )
    for name, data in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
        if data is not None and not (hasattr(data, "column_names") and hasattr(data, "__len__")):
            raise ConfigError(
                f"GRPOTrainer({name}=<{type(data).__name__}>): give a datasets.Dataset (an "
                "IterableDataset or a dict of datasets is not supported)"
            )
    if train_dataset is None:
        raise ConfigError("GRPOTrainer(train_dataset=None): give a datasets.Dataset with a prompt column")


def _lora_flags(peft_config: Any) -> list[str]:
    """A peft LoraConfig's rank, alpha and dropout into grpokit's options (args.json records them; the config
    itself is applied as given)."""
    if peft_config is None:
        return []
    if type(peft_config).__name__ != "LoraConfig":
        raise ConfigError(
            f"GRPOTrainer(peft_config=<{type(peft_config).__name__}>): only a peft LoraConfig is supported"
        )
    return [
        "--lora_rank",
        str(peft_config.r),
        "--lora_alpha",
        str(peft_config.lora_alpha),
        "--lora_dropout",
        str(peft_config.lora_dropout),
    ]
