"""Vision-language models: loading, and which parts train (ms-swift's --freeze_vit / --freeze_aligner).

A parameter belongs to the aligner when its name has a component in ``ALIGNER_NAMES``, else to the vision tower
when one is in ``VIT_NAMES``, else to the language model, which always trains.
"""

from __future__ import annotations

from pathlib import Path

import torch

from grpokit.config.args import ModelArguments
from grpokit.engines.vllm_mm import check_image_family
from grpokit.errors import ConfigError
from grpokit.modeling import attn_implementation

VIT_NAMES = ("visual", "vision_model", "vision_tower")  # Qwen-VL, Idefics3/SmolVLM, Gemma3/LLaVA
ALIGNER_NAMES = ("merger", "connector", "multi_modal_projector")


def vlm_part(name: str) -> str:
    """'aligner', 'vit' or 'llm' for a parameter or module name."""
    parts = set(name.split("."))
    if parts & set(ALIGNER_NAMES):
        return "aligner"
    return "vit" if parts & set(VIT_NAMES) else "llm"


def _frozen(margs: ModelArguments) -> set[str]:
    return {p for p, frozen in (("vit", margs.freeze_vit), ("aligner", margs.freeze_aligner)) if frozen}


def freeze_vlm_parts(model, margs: ModelArguments) -> None:
    """Full fine-tuning: switch gradients off for the frozen parts (LoRA freezes every base weight anyway)."""
    frozen = _frozen(margs)
    for name, param in model.named_parameters():
        if vlm_part(name) in frozen:
            param.requires_grad_(False)


def vlm_targets(model, margs: ModelArguments) -> list[str]:
    """LoRA's all-linear on a VLM: every linear layer of the parts that train (the language model, plus the
    vision tower or aligner when unfrozen), never the output head."""
    frozen = _frozen(margs)
    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and vlm_part(n) not in frozen and not n.endswith("lm_head")
    ]
    if not names:
        raise ConfigError(
            "--target_modules all-linear: this vision-language model has no linear layer outside "
            "its frozen parts; unfreeze with --freeze_vit false / --freeze_aligner false"
        )
    return names


def load_vlm(path: str, dtype, trust_remote_code: bool = False, attn_impl: str | None = None):
    """A vision-language model (``AutoModelForImageTextToText``) from a local folder."""
    from transformers import AutoModelForImageTextToText  # not at the top: text-only runs never need it

    if not Path(path).exists():
        raise ConfigError(f"model {path}: no such folder (grpokit loads local Hugging Face folders)")
    kwargs = {"attn_implementation": attn_implementation(attn_impl)} if attn_impl else {}
    try:
        return AutoModelForImageTextToText.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs
        )
    except (OSError, ValueError, ImportError) as e:
        what = f"with --attn_impl {attn_impl}" if attn_impl else "cannot load as a vision-language model"
        raise ConfigError(f"model {path}: {what} ({str(e).splitlines()[0]})") from e


def check_model_takes_images(dataset, tokenizer_or_processor, model_path: str | None, rollout=None) -> None:
    """One line when the dataset has images but the model is text-only (it has no image processor), or the
    rollouts would go through vLLM colocate with a model family whose images vLLM cannot take (``rollout``: the
    RolloutArguments; None means the transformers engine). A rollout server checks its own model: it refuses image
    requests for a text-only model, and its vLLM engine takes the same families as colocate."""
    if "images" not in dataset.column_names or not any(dataset["images"]):
        return
    if not hasattr(tokenizer_or_processor, "image_processor"):
        raise ConfigError(
            f"--model {model_path}: a text-only model was given a dataset with images; use a "
            "vision-language model (a folder with a processor_config.json or preprocessor_config.json)"
        )
    server = rollout is not None and rollout.vllm_mode == "server"
    if rollout is not None and rollout.use_vllm and not server and model_path is not None:
        check_image_family(model_path)
