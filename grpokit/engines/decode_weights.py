"""The decode loop's weights (engines/fast_decode.py): a Llama-family model read as the few fused tensors the loop
multiplies by, and the checks that the model is one the loop reproduces exactly.

q/k/v and gate/up become one dense matrix each, their weights concatenated once per ``FastDecoder`` (one decode
call); a plain LoRA adapter's update ``scale * B @ A`` is added as the fused weight is written, so adapters are
never merged into the model. Anything else (another architecture, sliding-window attention, RoPE tables that depend
on the sequence length, weights spread over devices, quantised or sharded weights, DoRA, LoRA on the embedding,
other peft tuners, a ``generation_config`` option only HF ``generate`` implements) raises ``Unsupported``, and the
engine samples with HF ``generate`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from grpokit.engines.decode_matmul import linear, weight_first

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # tables that do not depend on the sequence length
# generation_config fields that make HF generate add a processor or change the search (not implemented here),
# with the value that does nothing (besides None and empty): many saved configs spell the defaults out.
HF_ONLY_GENERATION_OPTIONS = {
    "min_length": 0,
    "min_new_tokens": 0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "sequence_bias": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "exponential_decay_length_penalty": None,
    "renormalize_logits": False,
    "remove_invalid_values": False,
    "min_p": 0.0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
    "watermarking_config": None,
    "num_beams": 1,
    "penalty_alpha": None,
    "dola_layers": None,
    "prompt_lookup_num_tokens": None,
    "max_time": None,
    "stop_strings": None,
    "num_return_sequences": 1,
}


class Unsupported(Exception):
    """This model (or its current state) is outside what the lean loop reproduces exactly."""


@dataclass
class Dense:
    weight: torch.Tensor
    bias: torch.Tensor | None

    def __post_init__(self) -> None:
        # decided once: a per-call check costs a small model's loop more than the product it would pick saves
        self.product = linear if weight_first(self.weight) else F.linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.bias)


@dataclass
class Norm:
    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # As the HF RMSNorm of these models: statistics in float32, weight applied in the input dtype.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


@dataclass
class Layer:
    attn_norm: Norm
    qkv: Dense
    qk_norm: Norm | None  # Qwen3: one RMSNorm over the head dim, q's weight on q heads and k's on k heads
    scaling: float
    out: Dense
    mlp_norm: Norm
    gate_up: Dense
    act: object
    down: Dense


def base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the HF model


def plain_weight(module, kind: type, shape: tuple[int, ...], name: str):
    """The plain torch layer behind ``module`` (a peft layer gives its base layer) and the LoRA factors its
    forward adds to the base weight: [(A, B, scale)], empty when none applies."""
    lora = []
    if getattr(module, "base_layer", None) is not None:
        if kind is not torch.nn.Linear:
            raise Unsupported(f"{name}: adapters on a {kind.__name__} layer")
        lora = _lora_factors(module, name)
        module = module.base_layer
    if type(module) is not kind:
        raise Unsupported(f"{name}: {type(module).__name__} layers")
    w = module.weight
    if tuple(w.shape) != shape or hasattr(w, "ds_id") or type(w.data) is not torch.Tensor:
        raise Unsupported(f"{name}: sharded or reshaped weights ({tuple(w.shape)}, expected {shape})")
    return module, lora


def _lora_factors(module, name: str) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(A [r, in], B [out, r], scale) of each active adapter of a peft LoRA layer: its forward adds
    x·(B·A·scale)ᵀ to the base layer's output. Empty when merged (already in the base weight) or disabled."""
    if not hasattr(module, "lora_A") or not hasattr(module, "scaling"):
        raise Unsupported(f"{name}: {type(module).__name__} adapters (LoRA only)")
    if module.disable_adapters:
        if module.merged:
            raise Unsupported(f"{name}: LoRA adapters merged but disabled")
        return []
    if module.merged:
        return []
    if getattr(module, "fan_in_fan_out", False):
        raise Unsupported(f"{name}: fan_in_fan_out LoRA layers")
    factors = []
    for adapter in module.active_adapters:
        if adapter not in module.lora_A:
            continue
        if (
            module.use_dora.get(adapter)
            or getattr(module, "lora_bias", {}).get(adapter)
            or adapter in (getattr(module, "lora_variant", None) or {})
        ):
            raise Unsupported(f"{name}: DoRA, a LoRA bias or another LoRA variant (adapter {adapter!r})")
        factors.append((module.lora_A[adapter].weight, module.lora_B[adapter].weight, float(module.scaling[adapter])))
    return factors


def _write_weight(out: torch.Tensor, weight: torch.Tensor, lora: list) -> None:
    """out = weight + Σ scale·B·A, in one pass over ``out``."""
    if not lora:
        out.copy_(weight)
        return
    for i, (a, b, scale) in enumerate(lora):
        base = weight if i == 0 else out
        if out.device.type == "cpu" and out.dtype in (torch.float16, torch.bfloat16):  # slow half matmuls on CPU
            out.copy_(base + (b.float() @ a.float() * scale).to(out.dtype))
        else:
            torch.addmm(base, b, a, alpha=scale, out=out)


def dense(modules: list, shapes: list[tuple[int, int]], name: str) -> Dense:
    """One linear map for several same-input linears (their outputs concatenated), LoRA updates added. The base
    weights are only read: with LoRA the sum is written to a new tensor, so nothing is merged and unmerged."""
    parts = [plain_weight(m, torch.nn.Linear, s, name) for m, s in zip(modules, shapes, strict=True)]
    first = parts[0][0].weight
    if len({layer.weight.device for layer, _ in parts}) != 1:
        raise Unsupported(f"{name}: weights on several devices")
    if not any(lora for _, lora in parts):
        if len(parts) == 1:
            return Dense(first, parts[0][0].bias)
        weight = torch.cat([layer.weight for layer, _ in parts])
    else:
        weight = first.new_empty((sum(s[0] for s in shapes), shapes[0][1]))
        row = 0
        for (layer, lora), (rows, _) in zip(parts, shapes, strict=True):
            _write_weight(weight[row : row + rows], layer.weight, lora)
            row += rows
    biases = [layer.bias for layer, _ in parts]
    if all(b is None for b in biases):
        return Dense(weight, None)
    bias = torch.cat(
        [b if b is not None else first.new_zeros(rows) for b, (rows, _) in zip(biases, shapes, strict=True)]
    )
    return Dense(weight, bias)


def norm(module, size: int, name: str) -> Norm:
    w = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    if w is None or eps is None or tuple(w.shape) != (size,) or not type(module).__name__.endswith("RMSNorm"):
        raise Unsupported(f"{name}: {type(module).__name__} is not the RMSNorm of these models")
    return Norm(w, float(eps))


def check_config(model) -> None:
    cfg = model.config
    arch = type(model).__name__
    if arch not in ARCHITECTURES:
        raise Unsupported(f"architecture {arch} (supported: {', '.join(ARCHITECTURES)})")
    if getattr(cfg, "use_sliding_window", False) or any(
        t != "full_attention" for t in getattr(cfg, "layer_types", None) or []
    ):
        raise Unsupported("sliding-window attention layers")
    devices = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    if len(devices) > 1:
        raise Unsupported(f"weights spread over devices {sorted(devices)} (device_map or offloading)")
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope not in STATIC_ROPE:
        raise Unsupported(f"rope type {rope!r} (its tables depend on the sequence length)")
    gc = getattr(model, "generation_config", None)
    for key, neutral in HF_ONLY_GENERATION_OPTIONS.items():
        value = getattr(gc, key, None)
        if value is not None and value != neutral and not (isinstance(value, (list, tuple, dict)) and not value):
            raise Unsupported(f"generation_config.{key}={value!r}")
