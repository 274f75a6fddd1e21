"""Model and tokenizer loading from local Hugging Face folders, and the dtype that ``--torch_dtype auto`` means on
this machine: the one place below the engines, the rollout server and the pipeline that all three load through."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpokit.errors import ConfigError


def cpu_has_fast_bf16() -> bool:
    """bf16 pays off on CPUs with native bf16 instructions (AVX512-BF16, AMX); elsewhere it is emulated and
    several times slower than float32 (measured here on an AVX2-only CPU: 6 vs 14 tokens/s).

    ``GRPOKIT_CPU_BF16=1`` (or ``0``) overrides the detection, so that `--torch_dtype auto` takes the bf16 (or the
    float32) path on any CPU: CI runs the tests under both, whichever CPU it has."""
    forced = os.environ.get("GRPOKIT_CPU_BF16", "")
    if forced:
        if forced not in ("0", "1"):
            raise ConfigError(f"GRPOKIT_CPU_BF16={forced!r}: use 1 (bf16 for --torch_dtype auto on a CPU) or 0 "
                              "(float32), or leave it unset to detect the CPU's bf16 instructions")
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


def load_tokenizer(path: str, trust_remote_code: bool = False):
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, padding_side="left")
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model {path}: cannot load a tokenizer ({str(e).splitlines()[0]})") from e
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def attn_implementation(attn_impl: str | None) -> str | None:
    """ms-swift's ``--attn_impl`` as transformers' ``attn_implementation``: ``flash_attn`` is ms-swift's older
    name for ``flash_attention_2``; None lets transformers choose (sdpa where the model supports it)."""
    return "flash_attention_2" if attn_impl == "flash_attn" else attn_impl


def load_causal_lm(path: str, dtype, trust_remote_code: bool = False, attn_impl: str | None = None):
    if not Path(path).exists():
        raise ConfigError(f"model {path}: no such folder (grpokit loads local Hugging Face folders; this machine "
                          "may have no hub access)")
    kwargs = {"attn_implementation": attn_implementation(attn_impl)} if attn_impl else {}
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError, ImportError) as e:
        what = f"with --attn_impl {attn_impl}" if attn_impl else "cannot load"
        raise ConfigError(f"model {path}: {what} ({str(e).splitlines()[0]})") from e
