"""--loss_type real (algorithms/losses_real.py) against hand-worked values, float64, and its config rules."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from grpokit.algorithms import LossConfig, LossInputs, compute_policy_loss, real_group_loss, real_scores
from grpokit.algorithms.option_checks import loss_config
from grpokit.config.parse import parse_train_args
from grpokit.errors import ConfigError

LN, E = math.log, math.exp


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def test_one_group_is_two_softplus_terms():
    # s = [0.2, −0.4], A = [+1, −1], τ = 0.5 → s/τ = [0.4, −0.8]
    # positive row 0: log(1 + e^−0.4) = 0.513015; negative row 1: log(1 + e^−0.8) = 0.371101 → 0.884116
    loss = real_group_loss(t([0.2, -0.4]), t([1.0, -1.0]), group_size=2, tau=0.5)
    assert loss.item() == pytest.approx(LN(1 + E(-0.4)) + LN(1 + E(-0.8)), abs=1e-12)
    assert loss.item() == pytest.approx(0.884116, abs=1e-6)


def test_negatives_share_one_log_sum_and_zero_advantage_is_negative():
    # s = [0.1, 0.3, −0.2], A = [0.5, −0.2, 0.0], τ = 1: row 0 positive; rows 1 and 2 (A = 0) negative →
    # log(1 + e^−0.1) + log(1 + e^0.3 + e^−0.2)
    loss = real_group_loss(t([0.1, 0.3, -0.2]), t([0.5, -0.2, 0.0]), group_size=3, tau=1.0)
    assert loss.item() == pytest.approx(LN(1 + E(-0.1)) + LN(1 + E(0.3) + E(-0.2)), abs=1e-12)


def test_a_one_label_group_adds_nothing_but_counts_in_the_mean():
    # group 0 as in the first test (0.884116), group 1 all positive → 0; the mean is over both groups
    loss = real_group_loss(t([0.2, -0.4, 0.5, 0.1]), t([1.0, -1.0, 2.0, 1.0]), group_size=2, tau=0.5)
    assert loss.item() == pytest.approx((LN(1 + E(-0.4)) + LN(1 + E(-0.8))) / 2, abs=1e-12)
    none_valid = t([0.3, -0.1]).requires_grad_(True)
    out = real_group_loss(none_valid, t([1.0, 1.0]), group_size=2, tau=0.5)
    assert out.item() == 0.0
    assert torch.autograd.grad(out, none_valid)[0].tolist() == [0.0, 0.0]


def test_gradient_weight_is_bounded_by_one_over_tau():
    # d/ds of log(1 + e^{−s/τ}) = −(1/τ)·σ(−s/τ): at s = 0 it is −1/(2τ) = −1 with τ = 0.5; a negative row +1
    s = t([0.0, 0.0]).requires_grad_(True)
    grad = torch.autograd.grad(real_group_loss(s, t([1.0, -1.0]), 2, 0.5), s)[0]
    assert grad.tolist() == pytest.approx([-1.0, 1.0], abs=1e-12)
    big = t([-50.0, 50.0]).requires_grad_(True)  # badly wrong: the weight saturates at 1/τ = 2, no blow-up
    grad = torch.autograd.grad(real_group_loss(big, t([1.0, -1.0]), 2, 0.5), big)[0]
    assert grad.tolist() == pytest.approx([-2.0, 2.0], abs=1e-9)


def test_gradcheck_float64():
    scores = torch.randn(6, dtype=torch.float64, requires_grad=True)
    adv = t([1.0, -1.0, 0.0, 2.0, -0.5, 0.3])
    assert torch.autograd.gradcheck(lambda s: real_group_loss(s, adv, 3, 0.7), (scores,))


def test_scores_are_the_masked_mean_log_ratio():
    # row 0: (ln 0.3 − ln 0.2 + ln 0.2 − ln 0.4)/2 = ln(0.75)/2; row 1: one token ln(0.25/0.5), padding −inf ignored
    logps = t([[LN(0.3), LN(0.2)], [LN(0.25), -math.inf]])
    old = t([[LN(0.2), LN(0.4)], [LN(0.5), -math.inf]])
    got = real_scores(logps, old, t([[1, 1], [1, 0]]))
    assert got.tolist() == pytest.approx([LN(0.75) / 2, LN(0.5)], abs=1e-12)


def batch(logps):
    return LossInputs(
        logps=logps,
        old_logps=t([[LN(0.2), LN(0.4)], [LN(0.5), 0.0]]),
        advantages=t([1.0, -1.0]),
        mask=t([[1, 1], [1, 0]]),
        ref_logps=t([[LN(0.3), LN(0.2)], [LN(0.5), 0.0]]),
    )


def test_compute_policy_loss_real_end_to_end_with_kl():
    # s = [ln(0.75)/2, ln 0.5] (previous test), τ = 0.5, A = [+1, −1]:
    # REAL = log(1 + e^{−2·s0}) + log(1 + e^{2·s1}) = log(1 + 1/0.75) + log(1 + 0.25)
    # KL: row 0 equals ref (0); row 1 token: ref/π = 0.5/0.25 = 2 → k3 = 2 − ln 2 − 1; token mean over 3 tokens
    logps = t([[LN(0.3), LN(0.2)], [LN(0.25), 0.0]]).requires_grad_(True)
    cfg = LossConfig(loss_type="real", beta=0.1, real_tau=0.5, num_generations=2)
    out = compute_policy_loss(batch(logps), cfg)
    real = LN(1 + 1 / 0.75) + LN(1.25)
    assert out.loss.item() == pytest.approx(real + 0.1 * (1 - LN(2)) / 3, abs=1e-12)
    assert out.metrics["kl"].item() == pytest.approx((1 - LN(2)) / 3, abs=1e-12)
    assert torch.autograd.gradcheck(lambda x: compute_policy_loss(batch(x), cfg).loss, (logps,))


def test_real_needs_whole_groups_in_the_micro_batch():
    with pytest.raises(ConfigError, match="multiple of num_generations"):
        real_group_loss(t([0.1, 0.2, 0.3]), t([1.0, -1.0, 1.0]), group_size=2, tau=0.5)


def _cfg(*flags):
    """Parsed and validated (parse_train_args runs grpokit.config.validate)."""
    return parse_train_args(["--model", "org/model", "--loss_type", "real", *flags])


def test_loss_config_carries_tau_and_group_size():
    cfg = _cfg("--real_tau", "0.25", "--num_generations", "4", "--per_device_train_batch_size", "8")
    lc = loss_config(cfg)
    assert (lc.real_tau, lc.num_generations) == (0.25, 4)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--num_generations", "4", "--per_device_train_batch_size", "6"], "per_device_train_batch_size 6"),
        (["--top_entropy_quantile", "0.5"], "--top_entropy_quantile 0.5"),
        (["--real_tau", "0"], "--real_tau 0"),
        (["--rollout_importance_sampling_mode", "token_truncate"], "--rollout_importance_sampling_mode"),
    ],
)
def test_real_refuses_what_it_would_ignore(flags, needle):
    with pytest.raises(ConfigError, match=needle):
        _cfg("--num_generations", "2", "--per_device_train_batch_size", "4", *flags)


def test_real_forces_unscaled_rewards_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = _cfg("--num_generations", "2", "--per_device_train_batch_size", "4", "--scale_rewards", "group")
    assert cfg.algorithm.scale_rewards == "none"
    assert "--scale_rewards group is replaced by none" in caplog.text


def test_fipo_is_refused_as_not_implemented():
    with pytest.raises(ConfigError, match="--loss_type fipo: ms-swift's FIPO .* is not implemented in grpokit"):
        parse_train_args(["--model", "org/model", "--loss_type", "fipo"])
