"""Per-token logps (and entropies) from the last hidden states, the output head applied a chunk of rows at a time.

The plain path materialises the logits [B, C, V] in the model's dtype, a float32 copy divided by the temperature,
and in backward a gradient of the same size: for V = 152k and 8 × 1024 completion tokens about 5 GB per float32
copy. ``chunked_lm_head_logps`` never holds more than one chunk of rows of logits. Forward computes, for each
chunk of ``chunk_size`` rows of the B·C positions, logits = hidden·Wᵀ + b, their logsumexp, the target's logit and
(when asked) the entropy, and keeps for backward only what exists anyway (hidden states, weight, bias, targets)
plus the [B·C] logsumexp. Backward recomputes each chunk's logits and turns them into the gradients of the hidden
states, the weight and the bias. The peak is O(chunk_size × V) in both passes, plus the weight's gradient, which
the plain path makes too.

The numbers are the plain path's: the matmul runs in the inputs' dtype (or autocast's, recorded in forward and
restored for the recomputation in backward), then float32 (float64 for float64 inputs), divided by the
temperature. The weight's gradient is summed over chunks in the weight's own dtype (one matmul-accumulate per
chunk, no second weight-sized buffer). Entropy is a statistic without gradient, as in ``entropy_from_logits``.
Each chunk's logits live in one float32 buffer that is shifted, exponentiated and scaled in place (two with
entropies), so a chunk costs about chunk_size × V × 4 bytes at its peak. With the sampler's kept set
(``support``, algorithms/kept_set.py) a chunk adds its [n, V] bool mask and a ``topk`` (top-p on a flat row: a
sort, 128 rows at a time); forward saves the [B·C] thresholds, from which backward rebuilds each chunk's mask.

When every row fits in one chunk and a gradient is needed, forward keeps that chunk's logits for backward, which
then skips the recomputation (one [N, H]·[H, V] matmul of three) and reads the same numbers: a second chunk-sized
buffer in forward, held until backward, none extra in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from grpokit.algorithms.kept_set import SamplerSupport, kept_mask, kept_threshold


def _row_chunks(n: int, size: int) -> list[slice]:
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


def _chunk_logits(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, low_rank: tuple | None, temperature: float, cdt: torch.dtype
) -> tuple[Tensor, torch.dtype]:
    """[n, V] logits / temperature in ``cdt`` (a tensor of our own, free to change in place), and the dtype the
    matmul produced them in. ``low_rank`` = (u [n, r], B [V, r]) adds u·Bᵀ in that dtype (a LoRA head)."""
    z = F.linear(hidden, weight, bias)  # [n, V] in the inputs' (or autocast's) dtype, as the model's own head
    if low_rank is not None:
        u, lr_weight = low_rank
        z = z.addmm_(u.to(z.dtype), lr_weight.to(z.dtype).t())
    zc = z.to(cdt)
    return zc.div_(temperature), z.dtype  # in place: one [n, V] buffer, not two


def _accumulate(grad: Tensor | None, gz: Tensor, gz_l: Tensor, x: Tensor, dtype: torch.dtype) -> Tensor:
    """grad [V, K] + gzᵀ·x over one chunk, in ``dtype`` (the weight's; gz_l is gz in the matmul's dtype). The first
    chunk's product starts the sum: no zero-filled weight-sized buffer to add it to."""
    gz = gz_l if gz_l.dtype == dtype else gz.to(dtype)  # autocast with full-precision weights: the weight's dtype
    if grad is None:  # out=: in ``dtype`` also when the caller's autocast is on (it casts no out= call)
        return torch.mm(gz.t(), x.to(dtype), out=x.new_empty((gz.shape[1], x.shape[1]), dtype=dtype))
    return grad.addmm_(gz.t(), x.to(dtype))


class _ChunkedHeadLogps(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, bias, u, lr_weight, targets, temperature, chunk_size, compute_entropy, support, keep_logits
    ):
        cdt = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
        n = hidden.shape[0]  # hidden [N, H], weight [V, H], u [N, r] and lr_weight [V, r] or None, targets [N]
        lse = torch.empty(n, dtype=cdt, device=hidden.device)  # [N]
        picked = torch.empty(n, dtype=cdt, device=hidden.device)  # [N]
        entropy = torch.empty(n, dtype=cdt, device=hidden.device) if compute_entropy else None
        tau = torch.empty(n, dtype=cdt, device=hidden.device) if support is not None else None  # [N] kept-set τ
        device = hidden.device.type
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device), device)
        ctx.logits = None  # one chunk's logits, kept for backward (``keep_logits``)
        keep_logits = keep_logits and n <= chunk_size
        for s in _row_chunks(n, chunk_size):
            low_rank = (u[s], lr_weight) if u is not None else None
            z, ctx.logits_dtype = _chunk_logits(hidden[s], weight, bias, low_rank, temperature, cdt)
            if keep_logits:  # backward reads them instead of recomputing; the shifted copy below is a new buffer
                ctx.logits = z
            picked[s] = z.gather(-1, targets[s].unsqueeze(-1)).squeeze(-1)
            keep = None
            if support is not None:  # the sampler's kept set (algorithms/kept_set.py): a [n, V] mask, this chunk's
                tau[s] = kept_threshold(z, support)
                keep = kept_mask(z, tau[s], targets[s], support)
            top = z.amax(-1, keepdim=True)  # [n, 1]
            z = z - top if keep_logits else z.sub_(top)  # from here on in place: the logits minus their max
            if entropy is None:
                e = z.exp_()
                lse[s] = top.squeeze(-1) + (e if keep is None else e.mul_(keep)).sum(-1).log()
            else:  # H = −Σ p log p = log S − Σ e·z / S with e = exp(z), S = Σ e (z shifted by its max)
                e = z.exp()
                total = e.sum(-1)
                entropy[s] = total.log() - torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(-1) / total
                lse[s] = top.squeeze(-1) + (total if keep is None else e.mul_(keep).sum(-1)).log()
                del e
            del z, keep  # before the next chunk's logits exist: one chunk at a time
        ctx.save_for_backward(hidden, weight, bias, u, lr_weight, targets, lse, tau)
        ctx.temperature, ctx.chunk_size, ctx.support = temperature, chunk_size, support
        if entropy is None:
            return picked - lse, None
        ctx.mark_non_differentiable(entropy)
        return picked - lse, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logps, _grad_entropy):
        hidden, weight, bias, u, lr_weight, targets, lse, tau = ctx.saved_tensors
        grads = [
            torch.empty_like(hidden) if ctx.needs_input_grad[0] else None,
            None,  # the weight's and lr_weight's gradients start with the first chunk's product
            torch.zeros(bias.shape, dtype=lse.dtype, device=bias.device) if ctx.needs_input_grad[2] else None,
            torch.empty_like(u) if ctx.needs_input_grad[3] else None,
            None,
        ]
        grad_h, grad_w, grad_b, grad_u, grad_lr = grads
        enabled, ac_dtype, device = ctx.autocast
        for s in _row_chunks(hidden.shape[0], ctx.chunk_size):
            z, ctx.logits = ctx.logits, None  # kept by forward (one chunk: the same numbers), else recomputed
            if z is None:
                with torch.autocast(device, dtype=ac_dtype, enabled=enabled):
                    low_rank = (u[s], lr_weight) if u is not None else None
                    z, _ = _chunk_logits(hidden[s], weight, bias, low_rank, ctx.temperature, lse.dtype)
            g = grad_logps[s].to(lse.dtype).unsqueeze(-1)  # [n, 1]
            keep = kept_mask(z, tau[s], targets[s], ctx.support) if ctx.support is not None else None
            gz = z.sub_(lse[s].unsqueeze(-1)).exp_()  # in place: d logp / d z = onehot − softmax (over K), × g
            gz = (gz if keep is None else gz.mul_(keep)).mul_(-g)
            gz.scatter_add_(-1, targets[s].unsqueeze(-1), g)
            gz.div_(ctx.temperature)  # [n, V] gradient of the unscaled logits
            if grad_b is not None:
                grad_b += gz.sum(0)
            gz_l = gz.to(ctx.logits_dtype)  # the dtype the forward matmul ran in
            if grad_h is not None:
                with torch.autocast(device, dtype=ac_dtype, enabled=enabled):
                    grad_h[s] = torch.mm(gz_l, weight).to(hidden.dtype)
            if grad_u is not None:
                grad_u[s] = torch.mm(gz_l, lr_weight.to(gz_l.dtype)).to(u.dtype)
            if ctx.needs_input_grad[1]:
                grad_w = _accumulate(grad_w, gz, gz_l, hidden[s], weight.dtype)
            if ctx.needs_input_grad[4]:
                grad_lr = _accumulate(grad_lr, gz, gz_l, u[s], lr_weight.dtype)
            del z, gz, gz_l, keep  # before the next chunk's logits exist: one chunk at a time
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, grad_u, grad_lr, None, None, None, None, None, None


def chunked_lm_head_logps(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    compute_entropy: bool = False,
    low_rank: tuple[Tensor, Tensor] | None = None,
    support: SamplerSupport | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log softmax((hidden·Wᵀ + b [+ u·Bᵀ]) / T)[targets] and optionally the entropy, ``chunk_size`` rows at a time.
    With ``support``, the log-softmax is over the sampler's kept set (``kept_set_logps``); the entropy stays the
    full distribution's.

    hidden [..., H], weight [V, H], bias [V] or None, targets [...]; ``low_rank`` = (u [..., r], B [V, r]) for a
    LoRA head's term s·A(dropout(h))·Bᵀ with u = s·A(dropout(h)). Returns (logps [...], entropies [...] or None),
    float32 (float64 for float64 inputs). Values and gradients equal ``selective_log_softmax`` of the full logits.
    """
    if chunk_size < 1:
        raise ValueError(f"chunked_lm_head_logps: chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"chunked_lm_head_logps: temperature must be > 0, got {temperature}")
    if hidden.shape[:-1] != targets.shape or weight.ndim != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"chunked_lm_head_logps: hidden [..., H], weight [V, H] and targets [...], got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(targets.shape)}"
        )
    u = lr_weight = None
    if low_rank is not None:
        u, lr_weight = low_rank
        if u.shape[:-1] != targets.shape or lr_weight.shape != (weight.shape[0], u.shape[-1]):
            raise ValueError(
                f"chunked_lm_head_logps: low_rank u [..., r] and B [V, r], got {tuple(u.shape)} and "
                f"{tuple(lr_weight.shape)}"
            )
        u = u.reshape(-1, u.shape[-1])
    lead = targets.shape
    trained = (hidden, weight, bias, u, lr_weight)
    keep_logits = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in trained)
    logps, entropy = _ChunkedHeadLogps.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        u,
        lr_weight,
        targets.reshape(-1).long(),
        float(temperature),
        int(chunk_size),
        bool(compute_entropy),
        support,
        keep_logits,
    )
    return logps.view(lead), (entropy.view(lead) if entropy is not None else None)
