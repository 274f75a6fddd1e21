"""One chunk covers every row: forward keeps its logits for backward instead of recomputing them. The gradients
are the recomputing path's (to float rounding: the chunks' matmuls differ in shape), with and without the
sampler's kept set and entropies, and gradcheck holds."""

from __future__ import annotations

import pytest
import torch

from grpokit.algorithms.chunked_logps import chunked_lm_head_logps
from grpokit.algorithms.kept_set import SamplerSupport

pytestmark = pytest.mark.numerics


def _grads(chunk_size: int, support, entropy: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 6, 8, dtype=dtype, generator=g, requires_grad=True)
    weight = torch.randn(40, 8, dtype=dtype, generator=g, requires_grad=True)
    bias = torch.randn(40, dtype=dtype, generator=g, requires_grad=True)
    targets = torch.randint(0, 40, (2, 6), generator=g)
    logps, ent = chunked_lm_head_logps(hidden, weight, bias, targets, 0.9, chunk_size, entropy, support=support)
    (logps * torch.linspace(-1, 2, 6)).sum().backward()
    return logps.detach(), ent, hidden.grad, weight.grad, bias.grad


@pytest.mark.parametrize("support", [None, SamplerSupport(top_k=7, top_p=0.9)])
@pytest.mark.parametrize("entropy", [False, True])
def test_kept_logits_give_the_recomputed_gradients(support, entropy):
    # 12 rows: chunk_size 12 keeps the logits; chunk_size 11 recomputes (two chunks) — the rows' numbers agree
    # to rounding
    kept = _grads(12, support, entropy)
    recomputed = _grads(11, support, entropy)
    for a, b in zip(kept, recomputed):
        if a is not None:
            assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)


def test_gradcheck_with_kept_logits():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(5, 4, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 9, (5,), generator=g)
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_lm_head_logps(h, w, None, targets, 1.1, 64)[0], (hidden, weight)
    )


def test_no_grad_keeps_nothing():
    # the old/ref logps pass: no graph, nothing kept past the call
    hidden, weight = torch.randn(3, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    with torch.no_grad():
        logps, _ = chunked_lm_head_logps(hidden, weight, None, torch.tensor([1, 2, 3]), chunk_size=8)
    assert logps.grad_fn is None and logps.shape == (3,)
