"""Load the policy (+ LoRA), the reference model and the tokenizer from local Hugging Face folders."""

from __future__ import annotations

import logging
from pathlib import Path

from grpokit.config.args import ModelArguments
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
    model = load(path, torch_dtype(margs.torch_dtype, for_training_weights=not lora), margs.trust_remote_code)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if margs.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        if lora:
            model.enable_input_require_grads()
    if vlm:  # the processor is the template (template/processor.py); LoRA or full, the chosen parts train
        tokenizer = load_processor(path, tokenizer)
        freeze_vlm_parts(model, margs)
    if lora:
        model = apply_lora(model, margs, vlm_targets(model, margs) if vlm else None)
    ref = None
    if beta != 0 and not lora:
        ref = load(margs.ref_model or path, torch_dtype(margs.torch_dtype, for_training_weights=False),
                             margs.trust_remote_code)
        ref.requires_grad_(False).eval()
    return model, tokenizer, ref


def apply_lora(model, margs: ModelArguments, vlm_linear: list[str] | None = None):
    from peft import LoraConfig, get_peft_model

    targets = margs.target_modules
    if vlm_linear is not None and targets == ["all-linear"]:  # a VLM: all-linear of the parts that train
        targets = vlm_linear
    # one entry with regex characters is a peft regex (full match on module names), e.g. top layers only:
    # '.*\.layers\.(2[0-9])\..*proj'; otherwise names are module-name suffixes, or all-linear
    if len(targets) == 1 and (targets[0] == "all-linear" or any(c in targets[0] for c in ".*[(|\\")):
        target = targets[0]
    else:
        target = targets
    config = LoraConfig(r=margs.lora_rank, lora_alpha=margs.lora_alpha, lora_dropout=margs.lora_dropout,
                        target_modules=target, task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as e:
        raise ConfigError(f"--target_modules {' '.join(targets)}: {str(e).splitlines()[0]}") from e


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
