"""Parts a Python caller hands to the assembly instead of options that name them (TRL's ``GRPOTrainer`` arguments):
a loaded model, a tokenizer, a peft ``LoraConfig``, datasets, reward callables, callback objects, a rollout
scheduler. Each is checked and used where the assembly would have built its own; the options still decide
everything else, and are checked the same way."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from grpokit.config.args import ModelArguments
from grpokit.errors import ConfigError
from grpokit.modeling import load_tokenizer
from grpokit.pipeline.models import apply_lora, check_tokenizer_covers, disable_dropout, freeze_parameters


@dataclass
class Supplied:
    """What the caller built. ``rewards``: (name, callable) pairs scored after the ``--reward_funcs`` and before
    the ``--reward_model``s; ``scheduler``: a RolloutScheduler, or an ``engine -> scheduler`` recipe for the
    trainer's own engine; ``owner``: the object the caller sees (TRL's trainer), handed to what asks for it."""

    train_dataset: Any = None
    eval_dataset: Any = None
    model: Any = None
    tokenizer: Any = None
    peft_config: Any = None
    rewards: list[tuple[str, Any]] = field(default_factory=list)
    callbacks: list = field(default_factory=list)
    scheduler: Any = None


def supplied_policy(model: Any, tokenizer: Any, margs: ModelArguments, beta: float, peft_config: Any = None):
    """(policy, tokenizer, ref or None) from a loaded causal LM, as ``load_policy`` makes them from a folder: the
    tokenizer given or the model folder's, gradient checkpointing, LoRA (``peft_config`` as given, else the
    --lora_* options) or freezing, and a frozen copy as the reference when the KL term needs one."""
    if not hasattr(model, "generation_config") or not callable(getattr(model, "get_input_embeddings", None)):
        raise ConfigError(
            f"model=<{type(model).__name__}>: give a transformers causal language model (AutoModelForCausalLM) or "
            "its folder"
        )
    tokenizer = load_tokenizer(margs.model, margs.trust_remote_code) if tokenizer is None else padded(tokenizer)
    check_tokenizer_covers(model, tokenizer, margs.model)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    lora = margs.tuner_type == "lora"
    ref = None
    if beta != 0 and not lora:
        ref = copy.deepcopy(model).requires_grad_(False).eval()
    if margs.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        if lora:
            model.enable_input_require_grads()
    if lora and not hasattr(model, "peft_config"):  # a PeftModel given keeps its adapters
        model = apply_lora(model, margs, peft_config=peft_config)
    elif not lora:
        freeze_parameters(model, margs)
    if margs.disable_dropout:
        disable_dropout(model, ref)
    return model, tokenizer, ref


def padded(tokenizer: Any) -> Any:
    """A caller's tokenizer as grpokit's own are loaded: prompts padded on the left, eos as the pad token when it
    has none (as TRL does)."""
    text = getattr(tokenizer, "tokenizer", tokenizer)  # a processor holds its tokenizer
    text.padding_side = "left"
    if text.pad_token is None:
        text.pad_token = text.eos_token
    return tokenizer


def model_folder(model: Any) -> str:
    """The folder (or hub id) a loaded model came from: where its tokenizer and config are read again."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if not name:
        raise ConfigError(
            f"model=<{type(model).__name__}>: the model names no folder (config._name_or_path is empty); load it "
            "with from_pretrained, or save it with save_pretrained and give the folder"
        )
    return name
