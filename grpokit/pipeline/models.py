"""Load the policy (+ LoRA), the reference model and the tokenizer from local Hugging Face folders."""

from __future__ import annotations

import logging
import re
from pathlib import Path

from grpokit.config.args import ModelArguments
from grpokit.config.validate import json_object
from grpokit.errors import ConfigError
from grpokit.modeling import load_causal_lm, load_tokenizer, torch_dtype
from grpokit.pipeline.default_model import ensure_default_model
from grpokit.pipeline.vlm_parts import freeze_vlm_parts, load_vlm, vlm_targets
from grpokit.template.processor import is_vlm_folder, load_processor

logger = logging.getLogger(__name__)


def resolve_model_path(margs: ModelArguments, log=print) -> str:
    if margs.model is not None:
        return margs.model
    return str(ensure_default_model(log=log))


def load_policy(margs: ModelArguments, beta: float, log=print):
    """Returns (policy, tokenizer, ref_model or None). LoRA policies need no ref copy: the base is the ref."""
    path = resolve_model_path(margs, log=log)
    tokenizer = load_tokenizer(path, margs.trust_remote_code)
    lora = margs.tuner_type == "lora"
    vlm = is_vlm_folder(path)
    load = load_vlm if vlm else load_causal_lm
    model = load(path, torch_dtype(margs.torch_dtype, for_training_weights=not lora), margs.trust_remote_code,
                 margs.attn_impl)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if margs.gradient_checkpointing:
        gc_kwargs = json_object("gradient_checkpointing_kwargs", margs.gradient_checkpointing_kwargs)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs or {"use_reentrant": False})
        model.config.use_cache = False
        if lora:
            model.enable_input_require_grads()
    if vlm:  # the processor is the template (template/processor.py); LoRA or full, the chosen parts train
        tokenizer = load_processor(path, tokenizer)
        freeze_vlm_parts(model, margs)
    if lora:
        model = apply_lora(model, margs, vlm_targets(model, margs) if vlm else None)
    else:
        freeze_parameters(model, margs)
    ref = None
    if beta != 0 and not lora:
        ref = load(margs.ref_model or path, torch_dtype(margs.torch_dtype, for_training_weights=False),
                   margs.trust_remote_code, margs.attn_impl)
        ref.requires_grad_(False).eval()
    return model, tokenizer, ref


def apply_lora(model, margs: ModelArguments, vlm_linear: list[str] | None = None):
    from peft import LoraConfig, get_peft_model

    targets = margs.target_modules
    if vlm_linear is not None and targets == ["all-linear"]:  # a VLM: all-linear of the parts that train
        targets = vlm_linear
    # one entry with regex characters is a peft regex (full match on module names), e.g. top layers only:
    # '.*\.layers\.(2[0-9])\..*proj'; otherwise names are module-name suffixes, or all-linear
    if margs.target_regex:  # ms-swift's name for that regex
        target, option = margs.target_regex, f"--target_regex {margs.target_regex}"
    elif len(targets) == 1 and (targets[0] == "all-linear" or any(c in targets[0] for c in ".*[(|\\")):
        target, option = targets[0], f"--target_modules {targets[0]}"
    else:
        target, option = targets, f"--target_modules {' '.join(targets)}"
    config = LoraConfig(r=margs.lora_rank, lora_alpha=margs.lora_alpha, lora_dropout=margs.lora_dropout,
                        target_modules=target, use_rslora=margs.use_rslora, use_dora=margs.use_dora,
                        task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        raise ConfigError(f"{option}: {str(e).splitlines()[0]}") from e


def freeze_parameters(model, margs: ModelArguments) -> None:
    """ms-swift's freezing for full fine-tuning, in its order: the bottom ``freeze_parameters_ratio`` of the
    parameters (by count, in module order), then the ``freeze_parameters`` prefixes and the regex; last the
    ``trainable_parameters`` prefixes and regex train again. A prefix or regex that names no parameter is an error."""
    named = list(model.named_parameters())
    if margs.freeze_parameters_ratio > 0:
        budget, seen = int(sum(p.numel() for _, p in named) * margs.freeze_parameters_ratio), 0
        for _, p in named:
            seen += p.numel()
            if seen > budget:
                break
            p.requires_grad_(False)
    for option, prefixes, regex, trainable in (
            ("freeze_parameters", margs.freeze_parameters, margs.freeze_parameters_regex, False),
            ("trainable_parameters", margs.trainable_parameters, margs.trainable_parameters_regex, True)):
        for prefix in prefixes:
            _set_trainable([p for n, p in named if n.startswith(prefix)], trainable, f"--{option} {prefix}")
        if regex is not None:
            pattern = re.compile(regex)
            _set_trainable([p for n, p in named if pattern.search(n)], trainable, f"--{option}_regex {regex}")


def _set_trainable(params: list, trainable: bool, option: str) -> None:
    if not params:
        raise ConfigError(f"{option}: no parameter of the model has such a name; parameter names look like "
                          "model.layers.0.mlp.up_proj.weight")
    for p in params:
        p.requires_grad_(trainable)


def load_for_inference(path: str, torch_dtype_name: str = "auto"):
    """A trained folder: a full model, or a LoRA adapter folder (adapter_config.json) on its base."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--model {path}: no such folder")
    dtype = torch_dtype(torch_dtype_name, for_training_weights=False)
    if (p / "adapter_config.json").is_file():
        import json

        from peft import PeftModel

        base_path = json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base_path or not Path(base_path).exists():
            raise ConfigError(f"--model {path}: LoRA adapter whose base model {base_path!r} is not on this machine")
        base = load_causal_lm(base_path, dtype)
        model = PeftModel.from_pretrained(base, str(p)).merge_and_unload()
        tok_path = str(p) if (p / "tokenizer_config.json").is_file() else base_path
        return model, load_tokenizer(tok_path)
    return load_causal_lm(str(p), dtype), load_tokenizer(str(p))
