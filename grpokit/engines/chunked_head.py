"""Per-token logps computed in place of the model's output head, so that the [B, C, V] logits never exist.

``ChunkedHead.swap(targets)`` replaces the ``forward`` of the output head (``get_output_embeddings()``) for one
call of the model. The model runs as usual, through whatever wraps it, so the hooks of DDP, FSDP2 and DeepSpeed
fire as always: ZeRO-3 gathers the head's weight around the head's forward, which is where the swapped forward
reads it, and the result passes the hooks that re-gather the weight for backward. Where the head would multiply
the last hidden states by its weight, the swapped forward calls ``chunked_lm_head_logps`` and returns
[B, n, 1] logps ([B, n, 2] with entropies) in the logits' place.

Heads it understands: a plain ``nn.Linear`` (tied to the embeddings or not), and peft's LoRA ``Linear`` with
plain adapters (u = s·A(dropout(h)) is computed as peft does, and u·Bᵀ joins each chunk's matmul). Anything
else, and models that transform the head's output (logit soft-capping or
scaling), take the plain path; ``plain_reason`` says why. A model that transforms the output in a way no config
field announces is caught after its forward: its output is not the tensor the head returned.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from grpokit.algorithms.chunked_logps import chunked_lm_head_logps
from grpokit.algorithms.kept_set import SamplerSupport

# config fields of models whose forward changes the head's output (gemma2/3, cohere, granite, falcon-h1)
_OUTPUT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")


def inner_model(model: nn.Module) -> nn.Module:
    """The model inside DDP / DeepSpeed / torch.compile wrappers (peft's wrapper forwards the calls it needs)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside the wrappers above and peft's (its ``config``, its input embeddings)."""
    inner = inner_model(model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def _output_transform(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in _OUTPUT_TRANSFORMS:
        value = getattr(text, name, None)
        if value is not None and value != 1 and value != 1.0:
            return f"its config sets {name}={value} (the model transforms the logits after the head)"
    return None


def _lora_parts(head: nn.Module) -> list[tuple[nn.Module, nn.Module, nn.Module, float]] | str:
    """(lora_A, lora_B, dropout, scaling) of each active plain adapter of a peft LoRA head, or why not."""
    if head.merged:
        return [] if not head.disable_adapters else "its LoRA adapters are merged and disabled"
    if head.disable_adapters:
        return []
    parts = []
    for name in head.active_adapters:
        if name not in head.lora_A.keys():
            continue
        if name in getattr(head, "lora_variant", {}) or head.lora_B[name].bias is not None:
            return f"its LoRA adapter {name!r} is not plain LoRA (DoRA, another variant, or a LoRA bias)"
        parts.append((head.lora_A[name], head.lora_B[name], head.lora_dropout[name], float(head.scaling[name])))
    return parts


def plain_reason(model: nn.Module) -> str | None:
    """Why this model's logps must take the plain path (None: the chunked head applies)."""
    inner = inner_model(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        return "it has no output embeddings (get_output_embeddings() is None)"
    transform = _output_transform(inner)
    if transform:
        return transform
    base = getattr(head, "base_layer", None)
    if base is not None and hasattr(head, "lora_A"):
        if type(base) is not nn.Linear:
            return f"its LoRA head wraps a {type(base).__name__}, not a Linear layer"
        if hasattr(base.weight, "ds_id"):  # ZeRO-3 gathers a LoRA head's weights per submodule, not in our call
            return "a LoRA head under DeepSpeed ZeRO-3"
        lora = _lora_parts(head)
        return lora if isinstance(lora, str) else None
    if type(head) is not nn.Linear:
        return f"its output head is a {type(head).__name__}, not a Linear layer"
    return None


class ChunkedHead:
    """Swaps the model's output head for one call; see the module docstring. Build it only where
    ``plain_reason(model)`` is None."""

    def __init__(
        self,
        model: nn.Module,
        temperature: float,
        chunk_size: int,
        compute_entropy: bool,
        support: SamplerSupport | None = None,
    ) -> None:
        inner = inner_model(model)
        self.head, self.model_name = inner.get_output_embeddings(), type(inner).__name__
        self.temperature, self.chunk_size, self.compute_entropy = temperature, chunk_size, compute_entropy
        self.support = support  # the sampler's kept set (logps renormalised over it), None: the full vocabulary

    def _parts(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
        """(weight, bias, low_rank) of the head for these hidden states; low_rank = (u, B) of LoRA adapters."""
        head = self.head
        if not hasattr(head, "lora_A"):
            return head.weight, head.bias, None
        base = head.base_layer
        lora = _lora_parts(head)
        if not lora:
            return base.weight, base.bias, None
        dtype = base.weight.dtype  # the low-rank term joins the base matmul in the base weight's dtype
        us = [
            (lora_a(dropout(hidden.to(lora_a.weight.dtype))) * scaling).to(dtype)  # [..., r] each
            for lora_a, _, dropout, scaling in lora
        ]
        bs = [lora_b.weight.to(dtype) for _, lora_b, _, _ in lora]  # [V, r] each
        if len(lora) == 1:
            return base.weight, base.bias, (us[0], bs[0])
        return base.weight, base.bias, (torch.cat(us, dim=-1), torch.cat(bs, dim=1))

    @contextmanager
    def swap(self, targets: torch.Tensor, rows: torch.Tensor | tuple | None = None):
        """Within the block, the head returns per-token results [*targets.shape, k] for ``targets`` (the hidden
        states indexed by ``rows`` first, when given: batch rows, or a (rows, positions) pair of index tensors).
        Yields ``take(out)`` → the checked result."""
        produced: list[torch.Tensor] = []

        def forward(hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            hidden = hidden[rows] if rows is not None else hidden
            if hidden.shape[:-1] != targets.shape:
                raise RuntimeError(
                    f"chunked logps: the output head got hidden states {tuple(hidden.shape)} for "
                    f"targets {tuple(targets.shape)}; run with --logps_chunk_size 0"
                )
            weight, bias, low_rank = self._parts(hidden)
            logps, ent = chunked_lm_head_logps(
                hidden,
                weight,
                bias,
                targets,
                self.temperature,
                self.chunk_size,
                self.compute_entropy,
                low_rank,
                self.support,
            )
            out = torch.stack([logps, ent], dim=-1) if ent is not None else logps.unsqueeze(-1)
            produced.append(out)
            return out

        def take(out) -> torch.Tensor:
            got = out.logits
            if not produced or got.shape != produced[-1].shape or got.data_ptr() != produced[-1].data_ptr():
                raise RuntimeError(
                    f"chunked logps: {self.model_name} changes what its "
                    "output head returns (soft-capping or scaling?); run with --logps_chunk_size 0"
                )
            return got

        self.head.forward = forward
        try:
            yield take
        finally:
            del self.head.forward
