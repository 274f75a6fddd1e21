"""The decode loop's dense layers at a few rows: ``F.linear`` arranged so that the CPU's BLAS runs them fast.

A decode step multiplies a handful of rows (one per running sequence) by each weight matrix. On the CPU, torch's
float32 ``x @ W.T`` for 2 to 8 rows takes a slow BLAS path, and a single row goes to a matrix-vector routine that
is slower still; the same product written ``(W @ x.T).T`` (the weight as the tall left operand) is a well-tuned
case. Measured with one thread on a 2-core AMD EPYC (AVX512; torch 2.13), the products of one decode step
through SmolLM2-135M's shapes (30 layers and the head), best of 3:

    rows                1     2     3     4     5     6     7     8
    x @ W.T (ms)       52    90   111    69    78    82    90    79
    as below (ms)      36    31    46    47    55    65    77    71

The exception is a matrix with fewer outputs than inputs (the MLP's down projection): from 3 rows on,
``x @ W.T`` is the faster one there. One row is duplicated into two (two rows' product is faster than one's).
The gain is in streaming a weight from memory: a weight small enough to stay in the CPU's caches from one token
to the next (a small model's) runs 1.1-3x faster as ``x @ W.T`` (on the tiny test model, weights of 16-66K
entries, the whole decode loop was 1.27x slower weight-first), so a weight under ``MIN_ENTRIES`` keeps
``F.linear`` (SmolLM2-135M's smallest has 332K), decided once per weight (``weight_first``). The arithmetic is the
same product; only the order of the float additions differs, as it does between BLAS kernels anyway. GPUs and
other dtypes keep ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FEW_ROWS = 8  # up to this many rows, the weight-first product is used (on CPU float32)
MIN_ENTRIES = 256 * 1024  # smaller weights stay in cache between tokens, where x @ W.T is the faster


def weight_first(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s products may go the weight-first way (``linear``): CPU float32, not under
    ``MIN_ENTRIES``. Elsewhere ``F.linear`` is the one to call."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.numel() >= MIN_ENTRIES


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a weight that ``weight_first`` admits, the weight-first way at a few rows
    (see above)."""
    rows = x.numel() // x.shape[-1]
    out_features, in_features = weight.shape
    if x.dtype != torch.float32 or rows > FEW_ROWS or (rows > 2 and out_features < in_features):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, in_features)
    cols = flat.repeat(2, 1) if rows == 1 else flat  # [rows, in]: two rows' product beats one row's
    out = torch.mm(weight, cols.T) if bias is None else torch.addmm(bias[:, None], weight, cols.T)
    return out[:, :rows].T.contiguous().view(*x.shape[:-1], out_features)
