"""A sampled token's logprob over the sampler's support: the kept set of top-k / top-p / min-p, renormalised.

When sampling truncates, the token was drawn from q(v) = p(v) / p(K) for v in the kept set K, not from the
model's full distribution p. The engines report log q; a trainer that takes log p instead scales every importance
ratio by p(K) (about top_p on average). This module computes log q from the logits, with the gradient through the
renormalisation: d log q(a) / dz = onehot(a) − q over K, 0 outside it.

The kept set is rebuilt from the logits being evaluated, by the rule the samplers apply (HF's warpers and vLLM's
``apply_top_k_top_p``, in that order), written as one threshold τ per position: K = {v : z_v ≥ τ, v not blocked}
∪ {a}, with z the logits already divided by the temperature and a the sampled token.

- blocked tokens (special tokens the engine is told never to emit) are out of K whatever their logit;
- top-k: τ ≥ the k-th largest logit (ties at it are kept, as both samplers do);
- top-p, on the logits top-k kept: sorted ascending, tokens are dropped while the cumulative probability is
  ≤ 1 − top_p (HF's and vLLM's rule); τ ≥ the smallest logit not dropped. Read from the top, a token is kept
  when the mass above it is < top_p, so the cut is found among the largest logits (the k of top-k, else the 512
  largest, sorting the whole row only where they hold less than top_p). Where tokens tie at the cut the
  samplers keep an arbitrary part of the tie (the sort's order), this rule keeps all of it;
- min-p: τ ≥ max z + log(min_p) (p_v ≥ min_p · p_max; the ratio does not change when K is renormalised);
- the sampled token is always in K: under the weights that sampled it, it is in K already; under later weights
  (a second PPO iteration) or another model (the reference), its logprob stays finite.

With the weights that sampled, the trainer's logits are the engine's (to float rounding), so K is the engine's
kept set and log q is the engine's processed logprob. The threshold is one float per position, so the chunked
paths save it for backward and rebuild the mask from it instead of sorting again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

_ROWS_PER_SORT = 128  # top-p sorts this many rows at once: values + int64 indices, 12 bytes per vocabulary entry
_NUCLEUS_GUESS = 512  # top-p looks for its cut among this many largest logits; it sorts only rows whose mass is
# not reached within them


@dataclass(frozen=True)
class SamplerSupport:
    """What the sampler kept: top_k ≤ 0 off, top_p 1 off, min_p 0 off, ``blocked`` token ids never emitted."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    blocked: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplerSupport: top_p={self.top_p} must be in (0, 1]; 1 keeps every token")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"SamplerSupport: min_p={self.min_p} must be in [0, 1); 0 keeps every token")

    @property
    def truncates(self) -> bool:
        """Whether any token can be left out (else the kept-set logprob is the full-vocabulary one)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0 or bool(self.blocked)


def _without_blocked(z: Tensor, s: SamplerSupport) -> Tensor:
    if not s.blocked:
        return z
    return z.index_fill(-1, torch.tensor(s.blocked, device=z.device), float("-inf"))


def _nucleus_cut(top: Tensor, lse: Tensor, top_p: float) -> tuple[Tensor, Tensor]:
    """The top-p cut among the largest logits ``top`` [n, m] (descending) of rows whose log-normaliser is ``lse``
    [n]: a token is kept when the mass of the tokens above it is < top_p (the ascending rule read from the top).
    Returns (τ [n], found [n]: the m tokens hold at least top_p, so no token below them is kept)."""
    q = (top.double() - lse.double()[:, None]).exp()  # [n, m]
    total = q.cumsum(-1)
    kept = ((total - q) < top_p).sum(-1).clamp(min=1)  # [n] the first `kept` tokens are kept
    return top.gather(-1, (kept - 1)[:, None])[:, 0], total[:, -1] >= top_p


def _threshold_rows(z: Tensor, s: SamplerSupport) -> Tensor:
    """[n, V] logits (blocked ones -inf) → [n] τ."""
    v = z.shape[-1]
    tau = z.new_full(z.shape[:1], float("-inf"))
    if 0 < s.top_k < v:
        top = z.topk(s.top_k, dim=-1).values  # [n, k] descending
        tau = top[:, -1]
        if s.top_p < 1.0:  # over what top-k kept (ties at the k-th logit included): the cut is among the k
            lse = torch.logsumexp(z.masked_fill(z < tau[:, None], float("-inf")), -1)
            tau = _nucleus_cut(top, lse, s.top_p)[0]
    elif s.top_p < 1.0:
        top = z.topk(min(_NUCLEUS_GUESS, v), dim=-1).values
        tau, found = _nucleus_cut(top, torch.logsumexp(z, -1), s.top_p)
        if not bool(found.all()):  # a flat distribution: sort those rows whole (the samplers' arithmetic)
            rows = (~found).nonzero()[:, 0]
            ascending = z[rows].sort(dim=-1).values
            dropped = (ascending.softmax(-1).cumsum(-1) <= 1.0 - s.top_p).sum(-1).clamp(max=v - 1)  # a prefix
            tau[rows] = ascending.gather(-1, dropped[:, None])[:, 0]
    if s.min_p > 0.0:
        tau = torch.maximum(tau, z.amax(-1) + math.log(s.min_p))
    return tau


@torch.no_grad()
def kept_threshold(z: Tensor, s: SamplerSupport) -> Tensor:
    """τ [N] of logits ``z`` [N, V] (divided by the temperature): the kept set is ``kept_mask(z, τ, ...)``."""
    out = z.new_empty(z.shape[:1])
    for start in range(0, z.shape[0], _ROWS_PER_SORT):
        rows = slice(start, start + _ROWS_PER_SORT)
        out[rows] = _threshold_rows(_without_blocked(z[rows], s), s)
    return out


@torch.no_grad()
def kept_mask(z: Tensor, tau: Tensor, index: Tensor, s: SamplerSupport) -> Tensor:
    """[N, V] bool: z ≥ τ, blocked tokens out, the sampled token ``index`` [N] in."""
    keep = z >= tau[:, None]
    if s.blocked:
        keep.index_fill_(-1, torch.tensor(s.blocked, device=z.device), False)
    return keep.scatter_(-1, index[:, None].long(), True)


def kept_set_logps(z: Tensor, index: Tensor, s: SamplerSupport) -> Tensor:
    """log q(index) = z[index] − logsumexp(z over K): [N, V], [N] → [N], differentiable in z (plain autograd; the
    reference the chunked paths are tested against)."""
    detached = z.detach()
    keep = kept_mask(detached, kept_threshold(detached, s), index, s)
    return z.gather(-1, index[:, None].long())[:, 0] - torch.logsumexp(z.masked_fill(~keep, float("-inf")), -1)


class _KeptSetLogSoftmax(torch.autograd.Function):
    """``kept_set_logps`` over [B, T, V] logits a chunk of rows at a time: forward keeps τ and the kept-set
    logsumexp [B, T]; backward rebuilds each chunk's mask from τ (no second sort)."""

    @staticmethod
    def forward(ctx, logits: Tensor, index: Tensor, s: SamplerSupport, chunk: int) -> Tensor:
        cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
        b, t, _ = logits.shape
        tau = torch.empty(b, t, dtype=cdt, device=logits.device)
        lse = torch.empty(b, t, dtype=cdt, device=logits.device)
        for i in range(b):
            for start in range(0, t, chunk):
                c = slice(start, min(start + chunk, t))
                z = logits[i, c].to(cdt, copy=True)  # changed in place below
                tau[i, c] = kept_threshold(z, s)
                keep = kept_mask(z, tau[i, c], index[i, c], s)
                lse[i, c] = torch.logsumexp(z.masked_fill_(~keep, float("-inf")), -1)
        picked = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1).to(cdt)
        ctx.save_for_backward(logits, index, tau, lse)
        ctx.support, ctx.chunk = s, chunk
        return picked - lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, index, tau, lse = ctx.saved_tensors
        b, t, _ = logits.shape
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        for i in range(b):
            for start in range(0, t, ctx.chunk):
                c = slice(start, min(start + ctx.chunk, t))
                z = logits[i, c].to(lse.dtype, copy=True)
                keep = kept_mask(z, tau[i, c], index[i, c], ctx.support)
                g = grad_out[i, c].to(lse.dtype).unsqueeze(-1)
                gz = z.sub_(lse[i, c].unsqueeze(-1)).exp_().mul_(keep).mul_(-g)  # −q·g on K, 0 elsewhere
                gz.scatter_add_(-1, index[i, c].unsqueeze(-1), g)
                grad[i, c] = gz.to(logits.dtype)
        return grad, None, None, None


def kept_set_log_softmax(logits: Tensor, index: Tensor, s: SamplerSupport, chunk: int = 1024) -> Tensor:
    """Kept-set logprobs of ``index`` [B, T] under ``logits`` [B, T, V] (divided by the temperature), float32
    (float64 for float64 logits); no more than ``chunk`` rows' mask at a time."""
    if logits.ndim != 3 or index.shape != logits.shape[:2]:
        raise ValueError(
            f"kept_set_log_softmax: logits [B, T, V] and index [B, T], got {tuple(logits.shape)} and "
            f"{tuple(index.shape)}"
        )
    return _KeptSetLogSoftmax.apply(logits, index.long(), s, chunk)
