"""CHORD math (grpokit.algorithms.chord): the mu schedule, the SFT token loss with and without phi, the mix."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algorithms import chord_mix, chord_mu, chord_sft_loss


def test_mu_warms_up_linearly_then_decays_by_cosine_to_the_valley():
    # warmup 4, decay 10, peak 0.8, valley 0.2
    assert chord_mu(0, 4, 10, 0.8, 0.2) == 0.0
    assert chord_mu(2, 4, 10, 0.8, 0.2) == pytest.approx(0.4)  # 2/4 * 0.8
    assert chord_mu(4, 4, 10, 0.8, 0.2) == pytest.approx(0.8)  # cos(0) = 1 → peak
    # t = 5 of 10: (1 + cos(pi/2)) / 2 = 0.5 → 0.2 + 0.6 * 0.5 = 0.5
    assert chord_mu(9, 4, 10, 0.8, 0.2) == pytest.approx(0.5)
    # t = 8: (1 + cos(0.8 pi)) / 2 = (1 - 0.809017) / 2 = 0.0954915 → 0.2 + 0.6 * 0.0954915 = 0.2572949
    assert chord_mu(12, 4, 10, 0.8, 0.2) == pytest.approx(0.2572949, abs=1e-6)
    assert chord_mu(14, 4, 10, 0.8, 0.2) == 0.2
    assert chord_mu(1000, 4, 10, 0.8, 0.2) == 0.2


def test_mu_without_warmup_starts_at_peak_and_equal_peak_valley_is_constant():
    # the port's schedule: warmup 0, decay 200, peak 0.9, valley 0.05; step 100: 0.05 + 0.85 * 0.5 = 0.475
    assert chord_mu(0, 0, 200, 0.9, 0.05) == pytest.approx(0.9)
    assert chord_mu(100, 0, 200, 0.9, 0.05) == pytest.approx(0.475)
    assert all(chord_mu(s, 3, 5, 0.3, 0.3) == pytest.approx(0.3 if s >= 3 else s / 3 * 0.3) for s in range(12))
    assert chord_mu(0, 0, 0, 0.7, 0.1) == 0.1  # no decay steps: the valley at once


def test_sft_loss_is_the_mean_nll_of_the_expert_tokens():
    # tokens p = 0.5, 0.25 (row 0) and 0.5 (row 1); the masked 4th token is ignored
    logps = torch.tensor([[math.log(0.5), math.log(0.25)], [math.log(0.5), math.log(0.1)]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # (ln 2 + ln 4 + ln 2) / 3 = 4 ln 2 / 3 = 0.924196
    assert chord_sft_loss(logps, mask).item() == pytest.approx(4 * math.log(2) / 3)


def test_phi_weights_each_token_by_p_times_one_minus_p():
    logps = torch.tensor([[math.log(0.5), math.log(0.25)], [math.log(0.5), math.log(0.1)]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # phi: 0.5*0.5 = 0.25, 0.25*0.75 = 0.1875, 0.25 → (0.25 ln2 + 0.1875 ln4 + 0.25 ln2) / 3 = 0.875 ln2 / 3
    assert chord_sft_loss(logps, mask, phi=True).item() == pytest.approx(0.875 * math.log(2) / 3)
    # a certain token (p = 1) gets weight 0
    assert chord_sft_loss(torch.zeros(1, 1), torch.ones(1, 1), phi=True).item() == 0.0


def test_sft_loss_of_an_empty_batch_is_zero():
    assert chord_sft_loss(torch.tensor([[-1.0]]), torch.zeros(1, 1)).item() == 0.0


def test_mix_weights_grpo_and_sft_by_mu():
    # (1 - 0.25) * 2 + 0.25 * 6 = 1.5 + 1.5 = 3
    assert chord_mix(torch.tensor(2.0), torch.tensor(6.0), 0.25).item() == pytest.approx(3.0)
    assert chord_mix(torch.tensor(2.0), torch.tensor(6.0), 0.0).item() == 2.0


@pytest.mark.parametrize("phi", [False, True])
def test_sft_loss_gradient_matches_finite_differences(phi):
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (2, 3))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    phi_w = None
    if phi:  # phi is a constant weight: fix it at the point of the check, as the loss detaches it
        p = torch.log_softmax(logits.detach(), -1).gather(-1, targets[..., None])[..., 0].exp()
        phi_w = p * (1 - p)

    def f(x):
        logps = torch.log_softmax(x, -1).gather(-1, targets[..., None])[..., 0]
        if phi_w is None:
            return chord_sft_loss(logps, mask)
        return (-logps * phi_w * mask).sum() / mask.sum()

    assert torch.autograd.gradcheck(f, (logits,))
    # the detached phi: chord_sft_loss's gradient equals that of the fixed-weight loss
    logps = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    (g,) = torch.autograd.grad(chord_sft_loss(logps, mask, phi=phi), logits)
    (g_ref,) = torch.autograd.grad(f(logits), logits)
    torch.testing.assert_close(g, g_ref)
