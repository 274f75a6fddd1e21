"""luspo and vespo (algorithms/losses_sequence.py) against hand-worked values, float64."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algorithms import LossConfig, LossInputs, PolicyTerms, compute_policy_loss, vespo_weights

LN = math.log


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def run(cfg, inp):
    out = compute_policy_loss(inp, cfg)
    return out, torch.autograd.grad(out.loss, inp.logps)[0]


# ------------------------------------------------------------------------------------------------------- luspo
def gspo_batch():
    """Row 0: ratios [1.5, 0.5], A = +1; row 1: ratio [0.5] and padding, A = −1."""
    logps = t([[LN(0.3), LN(0.2)], [LN(0.25), 0.0]]).requires_grad_(True)
    return LossInputs(
        logps=logps,
        old_logps=t([[LN(0.2), LN(0.4)], [LN(0.5), 0.0]]),
        advantages=t([1.0, -1.0]),
        mask=t([[1, 1], [1, 0]]),
    )


def test_luspo_weights_each_sequence_loss_by_its_length():
    # sequence ratios: row 0 s = exp((ln1.5 + ln0.5)/2) = √0.75 = 0.866 (inside [0.8, 1.2]) → ℓ_0 = −0.866;
    # row 1 s = 0.5 with A < 0 → clipped to 0.8 → ℓ_1 = +0.8.
    # LUSPO: (|o_0|·ℓ_0 + |o_1|·ℓ_1)/B = (2·(−0.866) + 1·0.8)/2 = −0.466
    # gradient: ℓ_0 = −s, ds/dlogp_t = s/|o_0| → d(2·ℓ_0/2)/dlogp_t = −s/2 = −0.433 per token; row 1 is clipped → 0.
    # GSPO (grpo normaliser) gives row 0 the weight 1/(2·2): −s/4, half of LUSPO's (|o_0| = 2)
    s = math.sqrt(0.75)
    out, grad = run(LossConfig(loss_type="luspo", importance_sampling_level="sequence"), gspo_batch())
    assert out.loss.item() == pytest.approx((2 * -s + 0.8) / 2, abs=1e-12)
    torch.testing.assert_close(grad, t([[-s / 2, -s / 2], [0.0, 0.0]]))
    _, gspo_grad = run(LossConfig(importance_sampling_level="sequence"), gspo_batch())
    torch.testing.assert_close(gspo_grad, t([[-s / 4, -s / 4], [0.0, 0.0]]))
    # one clip decision per sequence, over the 2 sequences: row 1 is low-clipped
    assert out.metrics["clip_ratio/low_mean"].item() == pytest.approx(1 / 2)


def test_luspo_kl_counts_each_trained_token_once():
    # on-policy (s = 1): ℓ = −A → (2·(−1) + 1·(+1))/2 = −0.5. ref = logp − ln2 → k3 = 0.5 + ln2 − 1 per trained
    # token; β = 0.1 adds 0.1·(3 tokens · k3)/B. (TRL would multiply each of the B×T positions' KL by the
    # length and average over B×T, padding included; grpokit sums trained tokens, like the policy term.)
    inp = gspo_batch()
    inp.old_logps = inp.logps.detach().clone()
    inp.ref_logps = inp.logps.detach() - LN(2.0)
    out, _ = run(LossConfig(loss_type="luspo", importance_sampling_level="sequence", beta=0.1), inp)
    kl = 0.5 + LN(2) - 1
    assert out.loss.item() == pytest.approx(-0.5 + 0.1 * 3 * kl / 2, abs=1e-12)


def test_luspo_token_level_sums_token_losses_per_sequence():
    # token ratios [1.5, 0.5 | 0.5], A = [+1 | −1]: PPO clip ε 0.2 → [−1.2, −0.5 | +0.8]; Σ / B = −0.9/2
    out, _ = run(LossConfig(loss_type="luspo"), gspo_batch())
    assert out.loss.item() == pytest.approx(-0.45, abs=1e-12)


# ------------------------------------------------------------------------------------------------------- vespo
def vespo_batch(rollout_is_weights=None):
    """Row 0: log-probs [ln.5, ln.25], old [ln.25, ln.25] → ratios [2, 1], W = 2, A = +1.
    Row 1: log-prob ln.5, old 0 → ratio 0.5, W = 0.5, A = −1; then padding (-inf, which must not leak)."""
    logps = t([[LN(0.5), LN(0.25)], [LN(0.5), float("-inf")]]).requires_grad_(True)
    return LossInputs(
        logps=logps,
        old_logps=t([[LN(0.25), LN(0.25)], [0.0, float("-inf")]]),
        advantages=t([1.0, -1.0]),
        mask=t([[1, 1], [1, 0]]),
        num_items=3.0,
        rollout_is_weights=rollout_is_weights,
    )


# φ(W) = W^k·e^{λ(1−W)}: row 0 (A ≥ 0: k 2, λ 3) 2²·e^{−3} = 4e^{−3} = 0.199148; row 1 (A < 0: k 3, λ 2)
# 0.5³·e^{2·0.5} = e/8 = 0.339785
PHI0, PHI1 = 4 * math.exp(-3), math.e / 8


def test_vespo_gamma_weight_values_and_gradient():
    # loss per token −φ·A·log π: row 0 −φ0·(ln.5 + ln.25) = 3·ln2·φ0; row 1 −φ1·(−1)·ln.5 = −ln2·φ1; / num_items 3
    # gradient −φ·A/3: the weight is a constant (d/dlogp of −φ·A·logp with φ detached)
    out, grad = run(LossConfig(loss_type="vespo"), vespo_batch())
    assert out.loss.item() == pytest.approx((3 * LN(2) * PHI0 - LN(2) * PHI1) / 3, abs=1e-12)
    torch.testing.assert_close(grad, t([[-PHI0 / 3, -PHI0 / 3], [PHI1 / 3, 0.0]]))
    assert out.metrics["vespo/phi_seq_mean"].item() == pytest.approx((PHI0 + PHI1) / 2)
    assert out.metrics["is_ratio/mean"].item() == pytest.approx((2 + 1 + 0.5) / 3)


def test_vespo_ignores_the_is_level():
    token, _ = run(LossConfig(loss_type="vespo"), vespo_batch())
    seq, _ = run(LossConfig(loss_type="vespo", importance_sampling_level="sequence"), vespo_batch())
    assert seq.loss.item() == token.loss.item()


def test_vespo_folds_token_rollout_weights_into_w():
    # rollout weights (π_old/π_rollout, truncated) [0.5, 1 | 2]: W = π_θ/π_rollout = [2·1·0.5, 0.5·2] = [1, 1]
    # → φ = 1 for both rows: plain REINFORCE over num_items: (−(ln.5 + ln.25) + ln.5)/3 = 2·ln2/3. The weights do
    # not multiply the loss a second time (that would give (0.5·ln2 + 2·ln2 − 2·ln2)/3).
    out, grad = run(LossConfig(loss_type="vespo"), vespo_batch(t([[0.5, 1.0], [2.0, 0.0]])))
    assert out.loss.item() == pytest.approx(2 * LN(2) / 3, abs=1e-12)
    torch.testing.assert_close(grad, t([[-1 / 3, -1 / 3], [1 / 3, 0.0]]))


def test_vespo_masked_rollout_token_silences_its_sequence():
    # token_mask dropped token (0,0): log 0 → floored at ln 1e-8, so W = 2·1e-8 and φ = (2e-8)²·e^{3(1−2e-8)}
    phi = vespo_weights(
        PolicyTerms(
            ratio=t([[1.0]]),
            logps=t([[0.0, 0.0]]),
            log_ratio=t([[LN(2.0), 0.0]]),
            adv=t([[1.0]]),
            mask=t([[1, 1]]),
            rollout_is_weights=t([[0.0, 1.0]]),
        ),
        LossConfig(),
    )
    assert phi.item() == pytest.approx(4e-16 * math.exp(3 * (1 - 2e-8)), rel=1e-9)


@pytest.mark.parametrize("adv, k, lam", [(0.0, 2.0, 3.0), (-1e-9, 3.0, 2.0)])
def test_vespo_zero_advantage_takes_the_positive_kernel(adv, k, lam):
    # W = 2: A = 0 counts as A ≥ 0 (k 2, λ 3) → 4e^{−3}; any A < 0 takes (k 3, λ 2) → 8e^{−2}
    terms = PolicyTerms(ratio=t([[2.0]]), logps=t([[0.0]]), log_ratio=t([[LN(2.0)]]), adv=t([[adv]]), mask=t([[1.0]]))
    assert vespo_weights(terms, LossConfig()).item() == pytest.approx(2**k * math.exp(-lam), rel=1e-12)


def test_vespo_log_w_is_clamped_as_trl():
    # Σ log r = 30 → log W clamped to 20: φ = exp(λ + k·20 − λ·e^20) underflows to 0 (not NaN);
    # Σ log r = −30 → log W = ln 1e-8: φ = exp(3 + 2·ln1e-8 − 3e-8) = e³·1e-16
    terms = PolicyTerms(
        ratio=t([[1.0], [1.0]]),
        logps=t([[0.0], [0.0]]),
        log_ratio=t([[30.0], [-30.0]]),
        adv=t([[1.0], [1.0]]),
        mask=t([[1.0], [1.0]]),
    )
    phi = vespo_weights(terms, LossConfig())
    assert phi[0].item() == 0.0
    assert phi[1].item() == pytest.approx(math.exp(3 - 3e-8) * 1e-16, rel=1e-9)


def test_vespo_on_policy_is_reinforce():
    # W = 1 → φ = e^{λ}·1·e^{−λ} = 1 whatever k, λ: gradient −A/num_items
    inp = vespo_batch()
    inp.old_logps = inp.logps.detach().clone()
    out, grad = run(LossConfig(loss_type="vespo", vespo_k_pos=7.0, vespo_lambda_pos=0.3), inp)
    torch.testing.assert_close(grad, t([[-1 / 3, -1 / 3], [1 / 3, 0.0]]))
    assert out.metrics["vespo/phi_seq_mean"].item() == pytest.approx(1.0)
