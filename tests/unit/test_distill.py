"""algorithms/distill.py: the teacher's per-token advantage term, by hand, against ms-swift's formula, and its
gradient (the sampled-action term has the reverse-KL gradient; a top-k / full-distribution term has none)."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algorithms import LossConfig, LossInputs, compute_policy_loss
from grpokit.algorithms.distill import distill_advantages, teacher_kl_per_token, teacher_log_ratio

TOL = {"atol": 1e-6, "rtol": 1e-6}


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def test_advantage_term_by_hand():
    # row 0: A = 0.5, tokens (teacher, student) = (-1, -2), (-3, -1)  → 0.5 + 0.5·1 = 1.0, 0.5 + 0.5·(-2) = -0.5
    # row 1: A = -1, one completion token (-0.5, -0.5) → -1; its padding column keeps A = -1 (never trained)
    out = distill_advantages(
        t([0.5, -1.0]),
        t([[-1.0, -3.0], [-0.5, float("-inf")]]),
        t([[-2.0, -1.0], [-0.5, float("-inf")]]),
        t([[1.0, 1.0], [1.0, 0.0]]),
        coef=0.5,
    )
    torch.testing.assert_close(out.advantages, t([[1.0, -0.5], [-1.0, -1.0]]))
    # k3 per token: d = 1 → e − 2 = 0.71828; d = −2 → e^-2 + 1 = 1.13534; d = 0 → 0; mean over 3 tokens
    assert out.metrics["teacher_kl"] == pytest.approx((math.e - 2 + math.exp(-2) + 1) / 3, abs=1e-12)


def test_teacher_equal_to_student_leaves_advantages_and_kl_zero():
    lp = -torch.rand(3, 4, dtype=torch.float64)
    out = distill_advantages(t([0.3, 0.0, -2.0]), lp, lp.clone(), torch.ones(3, 4), coef=1.0)
    torch.testing.assert_close(out.advantages, t([0.3, 0.0, -2.0]).unsqueeze(1).expand(3, 4))
    assert out.metrics["teacher_kl"] == 0.0


def test_per_token_base_advantages_and_shape_errors():
    base = t([[1.0, 2.0]])
    out = distill_advantages(base, t([[-1.0, -1.0]]), t([[-1.5, -0.5]]), t([[1.0, 1.0]]), coef=2.0)
    torch.testing.assert_close(out.advantages, t([[2.0, 1.0]]))  # 1 + 2·0.5, 2 + 2·(−0.5)
    with pytest.raises(ValueError, match="must have one shape"):
        distill_advantages(t([1.0]), t([[-1.0, -1.0]]), t([[-1.0]]), t([[1.0, 1.0]]), coef=1.0)


def test_k3_is_non_negative_and_ratio_masked():
    d = torch.linspace(-5, 5, 11, dtype=torch.float64).unsqueeze(0)
    assert (teacher_kl_per_token(d, torch.zeros_like(d), torch.ones_like(d)) >= 0).all()
    assert teacher_log_ratio(t([[float("nan")]]), t([[0.0]]), t([[0.0]])).item() == 0.0


def _expected_pg(logits, teacher_logp, adv_of):
    """Exact E_{a~π}[∇_z loss] of the GRPO loss on one token (ratio 1, old = π), summing over every action."""
    probs = torch.softmax(logits.detach(), -1)
    total = torch.zeros_like(logits)
    for a in range(logits.numel()):
        z = logits.clone().requires_grad_(True)
        lp = torch.log_softmax(z, -1)[a].view(1, 1)
        adv = adv_of(a, lp.detach())
        loss = compute_policy_loss(
            LossInputs(logps=lp, old_logps=lp.detach(), advantages=adv, mask=torch.ones(1, 1, dtype=z.dtype)),
            LossConfig(beta=0.0),
        ).loss
        total += probs[a] * torch.autograd.grad(loss, z)[0]
    return total


def test_sampled_token_term_has_the_reverse_kl_gradient_and_a_topk_term_has_none():
    # one position, vocabulary 4; the loss minimised in expectation is KL(π‖π_T) for the sampled-token term
    logits = t([0.3, -0.2, 1.1, 0.0])
    teacher = torch.log_softmax(t([2.0, -1.0, 0.0, 0.5]), -1)

    def sampled(a, student_lp):  # ours: A_t = c·(log π_T(a) − log π_old(a)), c = 1, A_i = 0
        return distill_advantages(t([0.0]), teacher[a].view(1, 1), student_lp, torch.ones(1, 1), 1.0).advantages

    def topk(a, student_lp):  # a top-2 KL term that does not look at the sampled action: the same number for all a
        p = torch.softmax(logits, -1)
        top = torch.topk(teacher, 2).indices
        value = -(p[top] * (torch.log(p[top]) - teacher[top])).sum()
        return value.view(1, 1)

    z = logits.clone().requires_grad_(True)
    p = torch.softmax(z, -1)
    reverse_kl = (p * (torch.log(p) - teacher)).sum()
    want = torch.autograd.grad(reverse_kl, z)[0]  # ∇_z KL(π‖π_T): the direction the loss must descend
    ours = _expected_pg(logits, teacher, sampled)
    torch.testing.assert_close(ours, want, **TOL)
    assert ours.abs().sum() > 1e-3
    assert _expected_pg(logits, teacher, topk).abs().max() < 1e-12  # zero on-policy gradient
