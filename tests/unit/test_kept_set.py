"""Kept-set logprobs (algorithms/kept_set.py): value and gradient against a direct float64 computation, HF's
warpers, hand-worked ties, and the chunked paths (plain [B, T, V] and the chunked output head)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from grpokit.algorithms import SamplerSupport, chunked_lm_head_logps, kept_set_log_softmax, kept_set_logps
from grpokit.algorithms.kept_set import kept_mask, kept_threshold


def direct_kept_logps(z: torch.Tensor, index: torch.Tensor, s: SamplerSupport) -> torch.Tensor:
    """The rule written per token, without sorting (float64): v is kept when it is not blocked, its logit is
    ≥ the k-th largest, the top-k tokens' probability at or below its logit exceeds 1 − top_p, and
    p_v ≥ min_p · p_max; the sampled token always. Then log q = z_a − logsumexp over the kept ones."""
    z64 = z.double()
    out = []
    for row, a in zip(z64, index.tolist(), strict=True):
        allowed = torch.ones_like(row, dtype=torch.bool)
        if s.blocked:
            allowed[list(s.blocked)] = False
        zr = row.masked_fill(~allowed, -math.inf)
        keep = allowed.clone()
        if s.top_k > 0:
            kth = sorted(zr.tolist(), reverse=True)[s.top_k - 1]
            keep &= zr >= kth
        if s.top_p < 1.0:
            p = torch.softmax(zr.masked_fill(~keep, -math.inf), -1)
            at_or_below = (p[None, :] * (zr[None, :] <= zr[:, None])).sum(-1)  # [V] mass of logits ≤ z_v
            keep &= at_or_below > 1.0 - s.top_p
        if s.min_p > 0.0:
            p = torch.softmax(zr, -1)
            keep &= p >= s.min_p * p.max()
        keep[a] = True
        out.append(row[a] - torch.logsumexp(row.masked_fill(~keep, -math.inf), -1))
    return torch.stack(out)


SUPPORTS = {
    "top_k": SamplerSupport(top_k=5),
    "top_p": SamplerSupport(top_p=0.8),
    "min_p": SamplerSupport(min_p=0.05),
    "combined": SamplerSupport(top_k=12, top_p=0.7, min_p=0.01, blocked=(0, 3)),
    "blocked": SamplerSupport(blocked=(1, 2, 7)),
}


@pytest.mark.parametrize("name", list(SUPPORTS))
def test_value_and_gradient_match_float64_direct(name):
    s = SUPPORTS[name]
    gen = torch.Generator().manual_seed(7)
    z = (torch.randn(24, 40, generator=gen, dtype=torch.float64) * 2.0).requires_grad_()
    index = torch.randint(0, 40, (24,), generator=gen)  # any token, kept or not: the sampled token is always in K
    weights = torch.randn(24, generator=gen, dtype=torch.float64)
    ref_z = z.detach().clone().requires_grad_()
    got, want = kept_set_logps(z, index, s), direct_kept_logps(ref_z, index, s)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(z.grad, ref_z.grad, rtol=0, atol=1e-12)
    # the gradient is onehot − q over K (0 outside it): each row's gradient sums to 0
    torch.testing.assert_close(z.grad.sum(-1), torch.zeros(24, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (z.grad == 0).any(), "some tokens are outside the kept set"


def test_top_k_ties_are_kept_by_hand():
    # z = [3, 2, 2, 2, 1, 0], top_k = 2: the 2nd largest is 2, the three 2s tie with it → K = {0, 1, 2, 3}
    # log q(0) = 3 − log(e³ + 3e²) = −log(1 + 3/e) = −0.7436
    z = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    got = kept_set_logps(z, torch.tensor([0]), SamplerSupport(top_k=2))
    torch.testing.assert_close(got, torch.tensor([-math.log(1 + 3 / math.e)], dtype=torch.float64))
    torch.testing.assert_close(got, direct_kept_logps(z, torch.tensor([0]), SamplerSupport(top_k=2)))


def test_top_p_tie_at_the_cut_is_kept_whole():
    # z = [2, 1, 1, 0]: p ∝ [e², e, e, 1] = [0.5345, 0.1966, 0.1966, 0.0723]. top_p = 0.7: ascending the cumulative
    # mass is 0.072, 0.269, 0.466, 1.0 and tokens with cumulative ≤ 0.3 are dropped: 0 and one of the tied 1s in
    # HF's sort; the rule keeps both 1s → K = {0, 1, 2}, log q(0) = 2 − log(e² + 2e) = −log(1 + 2/e) = −0.5514
    z = torch.tensor([[2.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    s = SamplerSupport(top_p=0.7)
    got = kept_set_logps(z, torch.tensor([0]), s)
    torch.testing.assert_close(got, torch.tensor([-math.log(1 + 2 / math.e)], dtype=torch.float64))
    torch.testing.assert_close(got, direct_kept_logps(z, torch.tensor([0]), s))


def test_matches_hf_warpers_processed_logprobs():
    # what the transformers engine reports: log_softmax of the scores after HF's top-k, top-p and min-p warpers
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(64, 500, generator=gen) * 3.0
    for s in (
        SamplerSupport(top_k=20),
        SamplerSupport(top_p=0.8),
        SamplerSupport(top_k=50, top_p=0.9),
        SamplerSupport(min_p=0.1),
    ):
        scores = z.clone()
        if s.top_k > 0:
            scores = TopKLogitsWarper(s.top_k)(None, scores)
        if s.top_p < 1:
            scores = TopPLogitsWarper(s.top_p)(None, scores)
        if s.min_p > 0:
            scores = MinPLogitsWarper(s.min_p)(None, scores)
        index = torch.multinomial(scores.softmax(-1), 1, generator=gen)[:, 0]
        want = scores.log_softmax(-1).gather(-1, index[:, None])[:, 0]
        torch.testing.assert_close(kept_set_logps(z, index, s), want, rtol=0, atol=2e-6)


def test_no_truncation_is_the_full_log_softmax():
    assert not SamplerSupport().truncates and SamplerSupport(top_k=1).truncates
    z = torch.randn(5, 30, dtype=torch.float64)
    index = torch.arange(5)
    torch.testing.assert_close(
        kept_set_logps(z, index, SamplerSupport()), z.log_softmax(-1).gather(-1, index[:, None])[:, 0]
    )
    with pytest.raises(ValueError, match="top_p=1.5"):
        SamplerSupport(top_p=1.5)


def test_threshold_is_a_float_per_position_and_rebuilds_the_mask():
    z = torch.randn(300, 64, dtype=torch.float64)  # more rows than one sort block
    s = SamplerSupport(top_k=10, top_p=0.6)
    tau = kept_threshold(z, s)
    assert tau.shape == (300,)
    keep = kept_mask(z, tau, torch.zeros(300, dtype=torch.long), s)
    assert (keep.sum(-1) <= 11).all() and (keep.sum(-1) >= 1).all()


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_plain_chunked_path_matches_reference(chunk):
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(2, 5, 33, generator=gen, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 33, (2, 5), generator=gen)
    s = SamplerSupport(top_k=8, top_p=0.75, blocked=(4,))
    got = kept_set_log_softmax(logits, index, s, chunk=chunk)
    ref_logits = logits.detach().clone().requires_grad_()
    want = kept_set_logps(ref_logits.view(-1, 33), index.view(-1), s).view(2, 5)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    g = torch.randn(2, 5, generator=gen, dtype=torch.float64)
    (got * g).sum().backward()
    (want * g).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("entropy", [False, True])
def test_chunked_head_matches_reference(entropy):
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 4, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 40, (3, 4), generator=gen)
    s = SamplerSupport(top_k=9, top_p=0.8)
    got, ent = chunked_lm_head_logps(
        hidden, weight, None, targets, temperature=0.7, chunk_size=5, compute_entropy=entropy, support=s
    )
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    z = (h2 @ w2.t()) / 0.7
    want = kept_set_logps(z.view(-1, 40), targets.view(-1), s).view(3, 4)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    if entropy:  # the entropy stays the full distribution's
        p = z.detach().softmax(-1)
        torch.testing.assert_close(ent, -(p * p.log()).sum(-1), rtol=0, atol=1e-10)
    g = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    (got * g).sum().backward()
    (want * g).sum().backward()
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=0, atol=1e-10)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=0, atol=1e-10)


def test_mismatch_metrics_by_hand_and_reduced_by_max():
    from grpokit.algorithms import mismatch_metrics
    from grpokit.runs.outputs import MetricsAccumulator

    # d = trainer − sampler on the masked tokens with a sampler logprob: [0.1, −0.3] (the NaN and the masked token
    # are left out) → max |d| 0.3, mean |d| 0.2, mean exp(d) = (e^0.1 + e^−0.3)/2 = 0.92304
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -4.0]])
    sampler = torch.tensor([[-1.1, -1.7, float("nan"), -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    m = mismatch_metrics(trainer, sampler, mask)
    assert float(m["mismatch/max_abs"]) == pytest.approx(0.3)
    assert float(m["mismatch/mean_abs"]) == pytest.approx(0.2)
    assert float(m["mismatch/ratio_mean"]) == pytest.approx((math.exp(0.1) + math.exp(-0.3)) / 2)
    assert mismatch_metrics(trainer, torch.full_like(sampler, float("nan")), mask) == {}
    acc = MetricsAccumulator()  # over micro-steps: the maximum is a maximum, the rest are means
    acc.add({"mismatch/max_abs": 0.3, "mismatch/mean_abs": 0.2})
    acc.add({"mismatch/max_abs": 0.1, "mismatch/mean_abs": 0.0})
    assert acc.pop() == pytest.approx({"mismatch/max_abs": 0.3, "mismatch/mean_abs": 0.1})


def test_top_p_on_a_flat_distribution_sorts_the_whole_row():
    # V = 2000 equal-ish logits: the 512 largest hold ~26% of the mass < top_p 0.8, so the row is sorted whole
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(4, 2000, generator=gen, dtype=torch.float64) * 0.01
    z[0] = torch.randn(2000, generator=gen, dtype=torch.float64) * 8  # a peaked row beside them: found in the 512
    index = torch.randint(0, 2000, (4,), generator=gen)
    s = SamplerSupport(top_p=0.8)
    torch.testing.assert_close(kept_set_logps(z, index, s), direct_kept_logps(z, index, s), rtol=0, atol=1e-12)
