"""`grpokit train`'s model options (the ModelArguments slice of ``TrainConfig``): the policy and reference models, how
they load, LoRA or full tuning, freezing, and which parts of a vision-language model train."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from grpokit.config.fields import opt as _opt

# --attn_impl's names (transformers' attn_implementation, and ms-swift's flash_attn for flash_attention_2)
ATTN_IMPLS = ("sdpa", "eager", "flash_attn", "flash_attention_2", "flash_attention_3", "flex_attention")


@dataclass
class ModelArguments:
    model: str | None = _opt(
        None,
        "policy model: a local folder in Hugging Face format (default: the built-in "
        "SmolLM2-135M-Instruct demo model, converted once and cached)",
    )
    ref_model: str | None = _opt(
        None,
        "reference model for the KL term (default: a frozen copy of --model; with "
        "LoRA the base model with adapters disabled)",
    )
    torch_dtype: Literal["auto", "float32", "bfloat16", "float16"] = _opt(
        "auto", "weights/compute dtype; auto = bfloat16 where the device supports it well, else float32"
    )
    tuner_type: Literal["full", "lora"] = _opt(
        "lora", "LoRA adapters (peft; --lora_rank, --lora_alpha, --target_modules), as in ms-swift, or full fine-tuning"
    )
    lora_rank: int = _opt(8, "LoRA rank r", ge=1)
    lora_alpha: int = _opt(32, "LoRA alpha", ge=1)
    lora_dropout: float = _opt(0.05, "LoRA dropout", ge=0, lt=1)
    target_modules: list[str] = _opt(["all-linear"], "LoRA target modules (peft names, or all-linear)")
    gradient_checkpointing: bool = _opt(False, "recompute activations in backward to save memory")
    trust_remote_code: bool = _opt(False, "allow custom model code from the model folder")
    disable_dropout: bool = _opt(False, "every dropout of the policy and reference at p = 0 (TRL's disable_dropout)")
    # ms-swift names
    attn_impl: str | None = _opt(
        None,
        "attention implementation: sdpa, eager, flash_attn (= flash_attention_2, "
        "CUDA only), flash_attention_3, flex_attention; default: transformers' choice",
        choices=ATTN_IMPLS,
    )
    gradient_checkpointing_kwargs: str | None = _opt(
        None, 'JSON object passed to gradient_checkpointing_enable (default {"use_reentrant": false})', json_object=True
    )
    target_regex: str | None = _opt(None, "LoRA targets as one regex over module names (instead of --target_modules)")
    use_rslora: bool = _opt(False, "rank-stabilised LoRA scaling alpha/sqrt(r) (peft use_rslora)")
    use_dora: bool = _opt(False, "weight-decomposed LoRA (peft use_dora)")
    freeze_parameters: list[str] = _opt(
        [], "full fine-tuning: freeze the parameters whose names start with these prefixes"
    )
    freeze_parameters_regex: str | None = _opt(
        None, "full fine-tuning: freeze the parameters whose names this regex matches (re.search)"
    )
    freeze_parameters_ratio: float = _opt(
        0.0,
        "full fine-tuning: freeze this fraction of the parameters, counted from the bottom layers (embeddings first)",
        ge=0,
        le=1,
    )
    trainable_parameters: list[str] = _opt([], "full fine-tuning: train these name prefixes again after the freezing")
    trainable_parameters_regex: str | None = _opt(
        None, "full fine-tuning: train the parameters this regex matches again after the freezing"
    )
    # vision-language models (docs/multimodal.md): which parts train, ms-swift's names and defaults
    freeze_vit: bool = _opt(
        True,
        "vision-language models: keep the vision tower frozen (false: train it, with "
        "LoRA adapters on its linear layers under --tuner_type lora)",
    )
    freeze_aligner: bool = _opt(
        True,
        "vision-language models: keep the aligner (the projector from vision to "
        "language) frozen (false: train it, with LoRA adapters under lora)",
    )
