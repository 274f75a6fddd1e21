"""Per-token log-probabilities and entropies from logits, without a full [B, T, V] log-softmax in memory.

``selective_log_softmax`` computes log p(index) = logit[index] − logsumexp(logits). The logsumexp runs over one
chunk of tokens at a time in float32 (float64 for float64 logits), and a hand-written backward rebuilds the
softmax chunk by chunk, so neither pass holds more than one chunk's float32 copy of the logits; autograd keeps
only the logits themselves (which exist anyway) and the [B, T] logsumexp. For bf16/fp16 logits this is also more
accurate than TRL's row-wise log_softmax in the logits' own dtype: the result is float32.

``entropy_from_logits`` is a statistic for entropy masks and logging; it is computed under ``no_grad``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

_TOKENS_PER_CHUNK = 1024  # float32 copy per chunk: 1024 × V × 4 bytes (≈ 0.6 GB for V = 152k)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(batch: int, length: int, size: int) -> Iterator[tuple[int, slice]]:
    for b in range(batch):
        for start in range(0, length, size):
            yield b, slice(start, min(start + size, length))


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, index: Tensor) -> Tensor:  # [B, T, V], [B, T] -> [B, T]
        cdt = _compute_dtype(logits.dtype)
        b, t, _ = logits.shape
        lse = torch.empty(b, t, dtype=cdt, device=logits.device)  # [B, T]
        for i, s in _chunks(b, t, _TOKENS_PER_CHUNK):
            lse[i, s] = torch.logsumexp(logits[i, s].to(cdt), dim=-1)
        picked = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1).to(cdt)  # [B, T]
        ctx.save_for_backward(logits, index, lse)
        return picked - lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor, None]:
        logits, index, lse = ctx.saved_tensors
        b, t, _ = logits.shape
        grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)
        for i, s in _chunks(b, t, _TOKENS_PER_CHUNK):
            g = grad_out[i, s].to(lse.dtype).unsqueeze(-1)  # [t, 1]
            chunk = -torch.exp(logits[i, s].to(lse.dtype) - lse[i, s].unsqueeze(-1)) * g  # -softmax·g, [t, V]
            chunk.scatter_add_(-1, index[i, s].unsqueeze(-1), g)  # + g at the chosen token
            grad_logits[i, s] = chunk.to(logits.dtype)
        return grad_logits, None


def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """log softmax(logits)[index]: [B, T, V], [B, T] -> [B, T] (float32, or float64 for float64 logits)."""
    if logits.ndim != 3 or index.shape != logits.shape[:2]:
        raise ValueError(
            f"selective_log_softmax: logits [B, T, V] and index [B, T], got {tuple(logits.shape)} "
            f"and {tuple(index.shape)}"
        )
    return _SelectiveLogSoftmax.apply(logits, index.long())


@torch.no_grad()
def entropy_from_logits(logits: Tensor, chunk_size: int = 128) -> Tensor:
    """Entropy −Σ p log p per token: [B, T, V] -> [B, T] float32, computed ``chunk_size`` tokens at a time."""
    if chunk_size < 1:
        raise ValueError(f"entropy_from_logits: chunk_size must be >= 1, got {chunk_size}")
    b, t, _ = logits.shape
    cdt = _compute_dtype(logits.dtype)
    out = torch.empty(b, t, dtype=cdt, device=logits.device)
    for i, s in _chunks(b, t, chunk_size):
        logp = F.log_softmax(logits[i, s].to(cdt), dim=-1)  # [chunk, V]
        out[i, s] = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(dim=-1)  # a -inf logit contributes 0
    return out
