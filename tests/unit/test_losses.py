"""Policy losses, IS levels and normalisers against hand-worked values; gradient properties."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from grpokit.algorithms import (
    IS_LEVELS,
    LOSS_CHECKS,
    LOSS_NORMALIZERS,
    POLICY_LOSSES,
    LossConfig,
    LossInputs,
    compute_policy_loss,
    entropy_mask,
    entropy_threshold,
    k3_kl,
    overlong_mask,
    validate_loss_config,
)
from grpokit.errors import ConfigError

LN = math.log
NEG_INF = float("-inf")


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def batch():
    """Two rows, T = 3. Row 0: two tokens + padding; row 1: a one-token completion.

    ratios r = π/π_old: row 0 [1.5, 0.5], row 1 [0.5];  advantages [1, -1].
    old probabilities 0.2, 0.4 | 0.5 → current 0.3, 0.2 | 0.25. Padding holds -inf in both (as a careless
    model might), which must not leak NaN.
    """
    old = t([[LN(0.2), LN(0.4), NEG_INF], [LN(0.5), NEG_INF, NEG_INF]])
    logps = t([[LN(0.3), LN(0.2), NEG_INF], [LN(0.25), NEG_INF, NEG_INF]]).requires_grad_(True)
    mask = t([[1, 1, 0], [1, 0, 0]])
    return LossInputs(logps=logps, old_logps=old, advantages=t([1.0, -1.0]), mask=mask, num_items=6.0)


def run(cfg, inp=None):
    inp = inp or batch()
    out = compute_policy_loss(inp, cfg)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert torch.isfinite(inp.logps.grad).all()
    return out, inp.logps.grad


# PPO clip, ε = 0.2 (range [0.8, 1.2]):
#   (0,0) r=1.5, A=+1: min(1.5, 1.2)   = 1.2  → loss -1.2  (high-clipped)
#   (0,1) r=0.5, A=+1: min(0.5, 0.8)   = 0.5  → loss -0.5
#   (1,0) r=0.5, A=-1: min(-0.5, -0.8) = -0.8 → loss +0.8  (low-clipped)
PPO_TOKENS = [-1.2, -0.5, 0.8]


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("grpo", ((-1.2 - 0.5) / 2 + 0.8) / 2),  # per-sequence mean, then batch mean = -0.025
        ("bnpo", sum(PPO_TOKENS) / 3),  # token mean over the micro-batch = -0.3
        ("dr_grpo", sum(PPO_TOKENS) / (2 * 4)),  # sum / (B · max_completion_length=4) = -0.1125
        ("dapo", sum(PPO_TOKENS) / 6),  # sum / num_items = -0.15
    ],
)
def test_ppo_clip_normalisers(loss_type, expected):
    out, _ = run(LossConfig(loss_type=loss_type, max_completion_length=4))
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    # clip metrics over the 3 trained tokens: one low-clipped (A<0, r<0.8), one high-clipped (A>0, r>1.2)
    assert out.metrics["clip_ratio/low_mean"].item() == pytest.approx(1 / 3)
    assert out.metrics["clip_ratio/high_mean"].item() == pytest.approx(1 / 3)
    assert out.metrics["clip_ratio/region_mean"].item() == pytest.approx(2 / 3)
    assert out.metrics["is_ratio/mean"].item() == pytest.approx((1.5 + 0.5 + 0.5) / 3)
    assert all(not v.requires_grad for v in out.metrics.values())


def test_ppo_clip_gradient_only_on_unclipped_tokens():
    # grpo normaliser: row 0 weight 1/(2·2), row 1 weight 1/(1·2).
    # (0,0) clipped → 0; (0,1) d(-r·A)/dlogp = -r·A = -0.5 → × 1/4 = -0.125; (1,0) clipped → 0; padding 0.
    _, grad = run(LossConfig())
    torch.testing.assert_close(grad, t([[0.0, -0.125, 0.0], [0.0, 0.0, 0.0]]))


def test_clip_higher_asymmetric():
    # ε_low 0.2, ε_high 0.6: (0,0) r=1.5 < 1.6 no longer clipped → -1.5; bnpo: (-1.5 - 0.5 + 0.8)/3 = -0.4
    out, _ = run(LossConfig(loss_type="bnpo", epsilon_high=0.6))
    assert out.loss.item() == pytest.approx(-0.4)
    assert out.metrics["clip_ratio/high_mean"].item() == 0.0


def test_two_sided_delta():
    # one token, r = 3, A = -1, ε 0.2.  Without δ: -min(-3, -1.2) = 3.  δ = 1.5: -min(-1.5, -1.2) = 1.5
    def inp():
        return LossInputs(
            logps=t([[LN(3.0)]]).requires_grad_(True), old_logps=t([[0.0]]), advantages=t([-1.0]), mask=t([[1.0]])
        )

    assert run(LossConfig(), inp())[0].loss.item() == pytest.approx(3.0)
    assert run(LossConfig(delta=1.5), inp())[0].loss.item() == pytest.approx(1.5)


def test_cispo_values_and_detached_weight():
    # ε_high = 1.2 (absolute cap): weights min(r, 1.2) = [1.2, 0.5 | 0.5]
    # per token -w·A·logπ: -1.2·ln0.3, -0.5·ln0.2, +0.5·ln0.25 (A=-1); sum / num_items 6
    cfg = LossConfig(loss_type="cispo", epsilon_high=1.2)
    out, grad = run(cfg)
    expected = (-1.2 * LN(0.3) - 0.5 * LN(0.2) + 0.5 * LN(0.25)) / 6
    assert out.loss.item() == pytest.approx(expected)
    # gradient = -w·A/6 exactly: the weight is a constant. If it carried gradient, the unclipped tokens would
    # get an extra -A·r·logπ/6 (d(r·logπ)/dlogπ = r·logπ + r).
    torch.testing.assert_close(grad, t([[-1.2 / 6, -0.5 / 6, 0.0], [0.5 / 6, 0.0, 0.0]]))
    # only the cap from above is a clip, counted where A > 0: token (0,0); named as in TRL and ms-swift
    assert out.metrics["cispo_clip_ratio"].item() == pytest.approx(1 / 3)
    assert not any(k.startswith("clip_ratio") for k in out.metrics)


def test_sapo_soft_gate():
    # gate σ(τ(r−1))·4/τ; τ = 1 for A > 0, 1.05 for A < 0
    # row 0 (A=1): σ(0.5)·4 + σ(-0.5)·4 = 4 → losses sum -4, row mean -2
    # row 1 (A=-1, r=0.5): σ(1.05·(-0.5))·4/1.05 → loss +that
    g1 = 1 / (1 + math.exp(0.525)) * 4 / 1.05
    out, _ = run(LossConfig(loss_type="sapo"))
    assert out.loss.item() == pytest.approx((-2 + g1) / 2)
    assert not any(k.startswith("clip_ratio") for k in out.metrics)


@pytest.mark.parametrize("loss_type", ["grpo", "sapo"])
def test_on_policy_gradient_is_plain_policy_gradient(loss_type):
    # logps == old: r = 1 exactly; d(loss)/dlogp = -A / (len · B) for both the PPO clip and the SAPO gate
    # (σ'(0)·τ·4/τ = 1). Rows: A=+1 over 2 tokens → -1/4 each; A=-1 over 1 token → +1/2.
    inp = batch()
    inp.old_logps = inp.logps.detach().clone()
    _, grad = run(LossConfig(loss_type=loss_type), inp)
    torch.testing.assert_close(grad, t([[-0.25, -0.25, 0.0], [0.5, 0.0, 0.0]]))


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
def test_ratio_exactly_one_on_policy(level):
    inp = batch()
    inp.old_logps = inp.logps.detach().clone()
    out, _ = run(LossConfig(importance_sampling_level=level), inp)
    assert out.metrics["is_ratio/mean"].item() == 1.0  # exact, not approximately
    assert out.loss.item() == pytest.approx((-1 + 1) / 2)  # -A per token, rows -1 and +1


def test_gspo_sequence_ratio():
    # row 0: mean log ratio (ln1.5 + ln0.5)/2 → r_seq = sqrt(0.75) = 0.866 (inside [0.8, 1.2]); A=1 → -0.866
    # row 1: r_seq = 0.5, A=-1 → clipped to 0.8 → +0.8;  grpo normaliser: (-0.866 + 0.8)/2
    expected = (-math.sqrt(0.75) + 0.8) / 2
    seq, _ = run(LossConfig(importance_sampling_level="sequence"))
    tok, _ = run(LossConfig(importance_sampling_level="sequence_token"))
    assert seq.loss.item() == pytest.approx(expected)
    assert tok.loss.item() == pytest.approx(expected)  # same value
    assert seq.metrics["is_ratio/mean"].item() == pytest.approx((math.sqrt(0.75) + 0.5) / 2)  # per sequence
    assert tok.metrics["is_ratio/mean"].item() == pytest.approx((2 * math.sqrt(0.75) + 0.5) / 3)  # per token


def clip_batch():
    """Rows of 3, 1 and 2 tokens with ratios 2 (A=+1), 0.5 (A=−1) and 1 (A=+1), and an empty row."""
    old = t([[0.0] * 3] * 4)
    logps = t([[LN(2.0)] * 3, [LN(0.5), 0, 0], [0.0] * 3, [0.0] * 3]).requires_grad_(True)
    mask = t([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]])
    return LossInputs(logps=logps, old_logps=old, advantages=t([1.0, -1.0, 1.0, 1.0]), mask=mask, num_items=6.0)


@pytest.mark.parametrize(
    "level, low, high, ratio_mean",
    [
        # one decision per sequence, over the 4 rows of the micro-batch (TRL: the empty row counts, ratio 1,
        # unclipped): row 0 r_seq = 2 > 1.2 with A > 0 → high; row 1 r_seq = 0.5 < 0.8 with A < 0 → low
        ("sequence", 1 / 4, 1 / 4, (2 + 0.5 + 1 + 1) / 4),
        # sequence_token: the same r_seq on every token, counted per trained token (ms-swift): 6 tokens, 3 high, 1 low
        ("sequence_token", 1 / 6, 3 / 6, (3 * 2 + 0.5 + 2 * 1) / 6),
        ("token", 1 / 6, 3 / 6, (3 * 2 + 0.5 + 2 * 1) / 6),
    ],
)
def test_clip_ratios_count_sequences_at_sequence_level(level, low, high, ratio_mean):
    out, _ = run(LossConfig(importance_sampling_level=level), clip_batch())
    assert out.metrics["clip_ratio/low_mean"].item() == pytest.approx(low)
    assert out.metrics["clip_ratio/high_mean"].item() == pytest.approx(high)
    assert out.metrics["clip_ratio/region_mean"].item() == pytest.approx(low + high)
    assert out.metrics["is_ratio/mean"].item() == pytest.approx(ratio_mean)


def test_cispo_clip_ratio_counts_sequences_at_sequence_level():
    # cap 1.5: only row 0 (r_seq = 2, A > 0) is capped → 1 of 4 sequences (per token it would be 3 of 6)
    out, _ = run(LossConfig(loss_type="cispo", epsilon_high=1.5, importance_sampling_level="sequence"), clip_batch())
    assert out.metrics["cispo_clip_ratio"].item() == pytest.approx(1 / 4)


def test_gspo_token_value_is_sequence_ratio_gradient_is_per_token():
    logps = t([[LN(0.3), LN(0.2), 0.0]]).requires_grad_(True)
    old = t([[LN(0.2), LN(0.4), 0.0]])
    mask = t([[1.0, 1.0, 0.0]])
    jac = {}
    for level in ("sequence", "sequence_token"):
        fn = IS_LEVELS[level]
        w = fn(logps - old, logps, mask)  # log importance weight
        # value: the sequence mean log ratio, (ln1.5 + ln0.5)/2, for every token
        torch.testing.assert_close(w.expand(1, 3)[0, :2], t([0.5 * LN(0.75)] * 2))
        jac[level] = torch.stack(
            [torch.autograd.grad(w.expand(1, 3)[0, i], logps, retain_graph=True)[0][0] for i in range(2)]
        )  # [2 tokens, 3 positions]
    # GSPO: every token's weight depends on all tokens equally (1/len = 0.5)
    torch.testing.assert_close(jac["sequence"], t([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]))
    # GSPO-token: token t's weight depends on token t only (identity Jacobian)
    torch.testing.assert_close(jac["sequence_token"], t([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))


def test_k3_kl_values_and_clamps():
    # d = ref − logp = −ln2: e^d − d − 1 = 0.5 + ln2 − 1 = 0.19315;  d = 0 → 0
    torch.testing.assert_close(k3_kl(t([LN(2.0), 0.0]), t([0.0, 0.0])), t([0.5 + LN(2) - 1, 0.0]))
    # d = 30 → clamped to 20 → e^20 − 21 → clamped to 10;  d = −30 → −20 → e^-20 + 19 → 10
    torch.testing.assert_close(k3_kl(t([0.0, 0.0]), t([30.0, -30.0])), t([10.0, 10.0]))


def test_beta_kl_added_and_rollout_weights_scale_policy_term_only():
    # one token on-policy (policy term -A = -1), ref = logp − ln2 → kl 0.19315; β = 0.1; IS weight 2
    # loss = 2·(−1) + 0.1·0.19315
    logps = t([[LN(0.5)]]).requires_grad_(True)
    inp = LossInputs(
        logps=logps,
        old_logps=logps.detach().clone(),
        advantages=t([1.0]),
        mask=t([[1.0]]),
        ref_logps=t([[LN(0.25)]]),
        rollout_is_weights=t([[2.0]]),
    )
    out, _ = run(LossConfig(beta=0.1), inp)
    kl = 0.5 + LN(2) - 1
    assert out.loss.item() == pytest.approx(-2 + 0.1 * kl)
    assert out.metrics["kl"].item() == pytest.approx(kl)


def test_beta_without_ref_logps_is_an_error():
    with pytest.raises(ConfigError, match="ref_logps"):
        compute_policy_loss(batch(), LossConfig(beta=0.04))


@pytest.mark.parametrize("loss_type", ["dapo", "cispo"])
def test_global_normaliser_needs_num_items(loss_type):
    inp = batch()
    inp.num_items = None
    with pytest.raises(ConfigError, match="num_items"):
        compute_policy_loss(inp, LossConfig(loss_type=loss_type, epsilon_high=5.0))


@pytest.mark.parametrize(
    "loss_type, level", [(lt, lv) for lt in sorted(POLICY_LOSSES) for lv in ("token", "sequence", "sequence_token")]
)
def test_fully_masked_row_no_nan(loss_type, level):
    # add a third row that is entirely padding (-inf log-probs): loss and gradient finite, its gradient 0
    base = batch()
    logps = torch.cat([base.logps.detach(), t([[NEG_INF] * 3])]).requires_grad_(True)
    inp = LossInputs(
        logps=logps,
        old_logps=torch.cat([base.old_logps, t([[NEG_INF] * 3])]),
        advantages=t([1.0, -1.0, 1.0]),
        mask=torch.cat([base.mask, t([[0.0] * 3])]),
        ref_logps=torch.cat([base.old_logps, t([[NEG_INF] * 3])]),
        num_items=6.0,
    )
    out, grad = run(
        LossConfig(
            loss_type=loss_type,
            importance_sampling_level=level,
            epsilon_high=5.0 if loss_type == "cispo" else 0.2,
            beta=0.04,
            num_generations=3,
        ),
        inp,
    )  # real: 1 group
    assert torch.equal(grad[2], torch.zeros(3, dtype=torch.float64))
    assert all(torch.isfinite(v) for v in out.metrics.values())


def test_overlong_filter_zero_gradient_for_truncated_row():
    # row 1 was truncated: overlong_mask drops it from the mask, so it gets no gradient. Row 0's tokens
    # give (-1.2 - 0.5)/2 = -0.85; the emptied row 1 gives 0 but still counts in the batch mean (ms-swift):
    # loss = (-0.85 + 0)/2
    inp = batch()
    inp.mask = overlong_mask(inp.mask, torch.tensor([False, True]))
    out, grad = run(LossConfig(), inp)
    assert out.loss.item() == pytest.approx(-0.85 / 2)
    assert torch.equal(grad[1], torch.zeros(3, dtype=torch.float64))
    assert grad[0, 1] != 0


def test_entropy_mask_zero_gradient_keeps_normaliser():
    # on-policy batch (r = 1): per-token losses -A = [-1, -1 | +1]. Entropies [0.9, 0.1 | 0.5], top 50%:
    # threshold = quantile 0.5 of [0.1, 0.5, 0.9] = 0.5 → tokens (0,0) and (1,0) train, (0,1) does not.
    # The normaliser still counts (0,1): row 0 = (-1 + 0)/2, row 1 = +1 → loss (-0.5 + 1)/2 = 0.25
    inp = batch()
    inp.old_logps = inp.logps.detach().clone()
    ent = t([[0.9, 0.1, 5.0], [0.5, 5.0, 5.0]])  # padding entropies are ignored
    thr = entropy_threshold(ent, inp.mask, 0.5)
    assert thr.item() == pytest.approx(0.5)
    inp.entropy_mask = entropy_mask(ent, inp.mask, thr)
    out, grad = run(LossConfig(), inp)
    assert out.loss.item() == pytest.approx(0.25)
    assert grad[0, 1] == 0 and grad[0, 0] != 0 and grad[1, 0] != 0


def test_entropy_mask_leaves_kl_term():
    # on-policy batch, policy term -A = [-1, -1 | +1]; entropy mask drops token (0,1). ref = logp − ln2 on every
    # token → k3 = e^{-ln2} + ln2 − 1 = 0.5 + ln2 − 1 = 0.193147 per trained token, masked or not; β = 0.1.
    # grpo: row 0 = (−1 + 0 + 2·0.1·kl)/2, row 1 = (+1 + 0.1·kl)/1 → loss = (row0 + row1)/2
    # gradient at the dropped token (0,1): policy 0; β·d(k3)/dlogp = 0.1·(1 − e^{ref−logp}) = 0.1·0.5, × 1/(2·2)
    inp = batch()
    inp.old_logps = inp.logps.detach().clone()
    inp.ref_logps = inp.logps.detach() - LN(2.0)
    inp.entropy_mask = t([[1, 0, 0], [1, 0, 0]])
    out, grad = run(LossConfig(beta=0.1), inp)
    kl = 0.5 + LN(2) - 1
    assert out.loss.item() == pytest.approx(((-1 + 0.2 * kl) / 2 + 1 + 0.1 * kl) / 2, abs=1e-12)
    assert grad[0, 1].item() == pytest.approx(0.1 * 0.5 / 4, abs=1e-12)


@pytest.mark.parametrize(
    "cfg, flag",
    [
        (LossConfig(epsilon_low=-0.1), "--epsilon"),
        (LossConfig(epsilon_high=-1.0), "--epsilon_high"),
        (LossConfig(epsilon_low=float("nan")), "--epsilon"),
        (LossConfig(beta=-0.01), "--beta"),
        (LossConfig(loss_type="ppo"), "--loss_type 'ppo'"),
        (LossConfig(importance_sampling_level="segment"), "--importance_sampling_level 'segment'"),
        (LossConfig(tau_neg=0.0), "--tau_neg"),
        (LossConfig(max_completion_length=0), "--max_completion_length"),
        (LossConfig(loss_type="cispo", epsilon_high=5.0, delta=8.0), "--delta applies"),
        (LossConfig(delta=1.1), "must exceed 1 \\+ epsilon_high"),
        (LossConfig(loss_type="cispo"), "cispo reads --epsilon_high"),
        (
            LossConfig(loss_type="vespo", delta=4.0),
            "--delta applies to the PPO-clip loss types \\(bnpo, dapo, dr_grpo, grpo, luspo\\)",
        ),
        (LossConfig(loss_type="vespo", vespo_k_pos=-1.0), "--vespo_k_pos -1.0"),
        (LossConfig(loss_type="vespo", vespo_lambda_neg=0.0), "--vespo_lambda_neg 0.0"),
        (LossConfig(loss_type="vespo", vespo_lambda_pos=float("nan")), "--vespo_lambda_pos nan"),
        (
            LossConfig(loss_type="vespo", rollout_importance_sampling_mode="sequence_truncate"),
            "--rollout_importance_sampling_mode sequence_truncate does not fit; use token_truncate or token_mask",
        ),
    ],
)
def test_validate_loss_config_rejects(cfg, flag):
    with pytest.raises(ConfigError, match=flag):
        validate_loss_config(cfg)


def test_validate_loss_config_accepts_defaults_and_variants():
    for cfg in (
        LossConfig(),
        LossConfig(loss_type="dapo", epsilon_high=0.28),
        LossConfig(delta=4.0),
        LossConfig(loss_type="cispo", epsilon_high=5.0),
        LossConfig(loss_type="sapo"),
        LossConfig(loss_type="sapo", importance_sampling_level="sequence"),  # as TRL, with a warning
        LossConfig(importance_sampling_level="sequence", epsilon_low=3e-4, epsilon_high=4e-4),
        LossConfig(loss_type="luspo", importance_sampling_level="sequence", delta=1.5),
        LossConfig(loss_type="vespo", rollout_importance_sampling_mode="token_mask"),
    ):
        validate_loss_config(cfg)


@pytest.mark.parametrize(
    "loss_type, level, warns",
    [
        ("luspo", "sequence", False),
        ("luspo", "token", True),
        ("luspo", "sequence_token", True),
        ("vespo", "token", False),
        ("vespo", "sequence", True),
        ("sapo", "token", False),
        ("sapo", "sequence", True),
        ("grpo", "sequence", False),
        ("dapo", "sequence", True),
        ("bnpo", "sequence_token", True),
        ("cispo", "sequence", True),
        ("dr_grpo", "token", False),
    ],
)
def test_unusual_is_level_warns_not_refuses(caplog, loss_type, level, warns):
    # TRL logs a warning (it does not raise) when a loss runs at a level its paper does not use
    caplog.set_level(logging.WARNING, logger="grpokit.algorithms.losses")
    validate_loss_config(
        LossConfig(
            loss_type=loss_type, importance_sampling_level=level, epsilon_high=5.0 if loss_type == "cispo" else 0.2
        )
    )
    messages = [r.getMessage() for r in caplog.records]
    assert bool(messages) == warns
    if warns:
        assert f"--loss_type {loss_type} with --importance_sampling_level {level}" in messages[0]


def test_registries_cover_every_loss_type():
    names = {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo", "real"}
    assert set(POLICY_LOSSES) == names and set(LOSS_NORMALIZERS) == names
    assert set(LOSS_CHECKS) <= names
    assert set(IS_LEVELS) == {"token", "sequence", "sequence_token"}


def test_kl_bias_correction_weighs_each_tokens_kl_by_its_ratio():
    # one token: π_old 0.5 → π 0.25 (ratio r = 0.5), reference 0.5; advantage 0, so only β·KL is left.
    # k3 = e^(ref − logπ) − (ref − logπ) − 1 = 2 − ln 2 − 1 = 0.30685; TRL's use_bias_correction_kl: r · k3
    k3 = 2 - LN(2) - 1

    def loss(correct: bool) -> float:
        inp = LossInputs(
            logps=t([[LN(0.25)]]).requires_grad_(True),
            old_logps=t([[LN(0.5)]]),
            advantages=t([0.0]),
            mask=t([[1.0]]),
            ref_logps=t([[LN(0.5)]]),
        )
        return run(LossConfig(loss_type="grpo", beta=0.1, kl_bias_correction=correct), inp)[0].loss.item()

    assert loss(False) == pytest.approx(0.1 * k3)
    assert loss(True) == pytest.approx(0.1 * 0.5 * k3)
