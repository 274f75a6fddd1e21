"""Model and tokenizer loading from local Hugging Face folders, and the dtype that ``--torch_dtype auto`` means on
this machine: the one place below the engines, the rollout server and the pipeline that all three load through."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpokit.errors import ConfigError

logger = logging.getLogger(__name__)

# files that carry a tokenizer's vocabulary (fast tokenizer, sentencepiece, BPE, WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def cpu_has_fast_bf16() -> bool:
    """bf16 pays off on CPUs with native bf16 instructions (AVX512-BF16, AMX); elsewhere it is emulated and
    several times slower than float32 (measured here on an AVX2-only CPU: 6 vs 14 tokens/s).

    ``GRPOKIT_CPU_BF16=1`` (or ``0``) overrides the detection, so that `--torch_dtype auto` takes the bf16 (or the
    float32) path on any CPU: CI runs the tests under both, whichever CPU it has."""
    forced = os.environ.get("GRPOKIT_CPU_BF16", "")
    if forced:
        if forced not in ("0", "1"):
            raise ConfigError(
                f"GRPOKIT_CPU_BF16={forced!r}: use 1 (bf16 for --torch_dtype auto on a CPU) or 0 "
                "(float32), or leave it unset to detect the CPU's bf16 instructions"
            )
        return forced == "1"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype_name(name: str) -> str:
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if cpu_has_fast_bf16() else "float32"


def torch_dtype(name: str, for_training_weights: bool):
    """Weights dtype. Full fine-tuning keeps float32 master weights and uses bf16 autocast instead."""
    name = resolve_dtype_name(name)
    if for_training_weights and name in ("bfloat16", "float16"):
        return torch.float32
    return getattr(torch, name)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def load_tokenizer(path: str, trust_remote_code: bool = False):
    folder = Path(path)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES) and not trust_remote_code:
        raise ConfigError(
            f"--model {path}: the folder has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            "copy the tokenizer files that came with the model into it"
        )
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, padding_side="left")
    except Exception as e:  # noqa: BLE001 - a broken tokenizer file raises anything from json to the Rust side
        what = "config.json" if folder.is_dir() and not _opens_as_json(folder / "config.json") else "a tokenizer"
        raise ConfigError(f"--model {path}: cannot load {what} ({_first_line(e)})") from e
    if len(tok) < 2:
        raise ConfigError(
            f"--model {path}: the tokenizer loaded from the folder is empty ({len(tok)} tokens); "
            f"check its tokenizer files ({', '.join(TOKENIZER_FILES)})"
        )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def attn_implementation(attn_impl: str | None) -> str | None:
    """ms-swift's ``--attn_impl`` as transformers' ``attn_implementation``: ``flash_attn`` is ms-swift's older
    name for ``flash_attention_2``; None lets transformers choose (sdpa where the model supports it)."""
    return "flash_attention_2" if attn_impl == "flash_attn" else attn_impl


def load_causal_lm(path: str, dtype, trust_remote_code: bool = False, attn_impl: str | None = None):
    if not Path(path).exists():
        raise ConfigError(
            f"model {path}: no such folder (grpokit loads local Hugging Face folders; this machine "
            "may have no hub access)"
        )
    kwargs = {"attn_implementation": attn_implementation(attn_impl)} if attn_impl else {}
    warn_if_not_causal_lm(path)
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
    except Exception as e:  # noqa: BLE001 - safetensors, json, torch and the model code raise what they like
        if attn_impl and isinstance(e, (OSError, ValueError, ImportError)):
            raise ConfigError(f"model {path}: with --attn_impl {attn_impl} ({str(e).splitlines()[0]})") from e
        raise ConfigError(f"model {path}: cannot load{broken_file(Path(path))} ({_first_line(e)})") from e


def broken_file(folder: Path) -> str:
    """`` <file>`` for the first file of a model folder that does not open (config.json, a safetensors file whose
    header or size is wrong), or ``""`` when each opens on its own."""
    if not _opens_as_json(folder / "config.json"):
        return " config.json"
    from safetensors import safe_open

    for weights in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(weights), "pt") as f:
                f.keys()
        except Exception:  # noqa: BLE001 - SafetensorError, OSError
            return f" {weights.name} (truncated or not a safetensors file)"
    return ""


def _opens_as_json(path: Path) -> bool:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return True


def warn_if_not_causal_lm(path: str) -> bool:
    """A warning (and True) when the folder's config names an architecture without a language-model head (a
    sequence-classification checkpoint): its body loads into a causal LM, with a fresh, untrained output head."""
    try:
        archs = json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False  # the loader reports a missing or broken config itself
    if not archs or any(str(a).endswith(_CAUSAL_HEADS) for a in archs):
        return False
    logger.warning(
        "model %s: its config names %s, not a causal language model (…ForCausalLM); it loads as "
        "one with a newly initialised output head, so it starts from random next-token predictions. "
        "Pass the base or instruct checkpoint instead",
        path,
        ", ".join(map(str, archs)),
    )
    return True


def load_trained(path: str, dtype, trust_remote_code: bool = False):
    """A trained folder as a causal LM: a full model, or a LoRA adapter folder (adapter_config.json, what a LoRA
    run's final_model holds) merged into its base, which must be on this machine."""
    p = Path(path)
    if not (p / "adapter_config.json").is_file():
        return load_causal_lm(str(p), dtype, trust_remote_code=trust_remote_code)
    from peft import PeftModel  # optional heavy import: only adapter folders need it

    base_path = json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base_path or not Path(base_path).exists():
        raise ConfigError(f"{path}: LoRA adapter whose base model {base_path!r} is not on this machine")
    base = load_causal_lm(base_path, dtype, trust_remote_code=trust_remote_code)
    return PeftModel.from_pretrained(base, str(p)).merge_and_unload()
