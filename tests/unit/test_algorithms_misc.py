"""Log-probs, entropies, KL penalty, filters, rollout importance weights and the reference-model EMA."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from grpokit.algorithms import (
    ROLLOUT_IS_MODES,
    ema_update_,
    entropy_from_logits,
    entropy_mask,
    entropy_threshold,
    groups_with_signal,
    kl_reward_penalty,
    overlong_mask,
    rollout_importance_weights,
    selective_log_softmax,
    validate_entropy_quantile,
    validate_rollout_is_options,
)
from grpokit.errors import ConfigError

LN = math.log


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def reference_logps(logits, index):
    return F.log_softmax(logits.double(), dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------- selective_log_softmax / entropy


def test_selective_log_softmax_hand_value():
    # logits [0, ln3] → softmax [1/4, 3/4]; choose index 1 → ln(3/4), index 0 → ln(1/4)
    logits = t([[[0.0, LN(3.0)], [0.0, LN(3.0)]]])
    out = selective_log_softmax(logits, torch.tensor([[1, 0]]))
    torch.testing.assert_close(out, t([[LN(0.75), LN(0.25)]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_log_softmax_matches_log_softmax(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 50, generator=g) * 4).to(dtype)
    index = torch.randint(0, 50, (3, 5), generator=g)
    out = selective_log_softmax(logits, index)
    assert out.dtype == torch.float32  # bf16 logits give float32 log-probs, not bf16-rounded ones
    torch.testing.assert_close(out.double(), reference_logps(logits, index), atol=1e-5, rtol=1e-5)


def test_selective_log_softmax_gradient():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 7, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 7, (2, 4), generator=g)
    assert torch.autograd.gradcheck(lambda x: selective_log_softmax(x, index), (logits,))
    # and equal to autograd through the full log_softmax for a random upstream gradient
    up = torch.randn(2, 4, generator=g, dtype=torch.float64)
    (ours,) = torch.autograd.grad((selective_log_softmax(logits, index) * up).sum(), logits)
    (ref,) = torch.autograd.grad((reference_logps(logits, index) * up).sum(), logits)
    torch.testing.assert_close(ours, ref)


def test_selective_log_softmax_keeps_no_float32_copy_of_bf16_logits():
    # memory-lean: autograd saves the bf16 logits (which exist anyway) and a [B, T] logsumexp, never a
    # [B, T, V] float32 copy
    logits = torch.randn(2, 3, 11, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(x):
        saved.append((x.dtype, tuple(x.shape)))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = selective_log_softmax(logits, torch.zeros(2, 3, dtype=torch.long))
    assert (torch.float32, (2, 3, 11)) not in saved
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_selective_log_softmax_with_masked_vocabulary():
    # a -inf logit (masked vocabulary entry) has probability 0 and must not give NaN values or gradients
    logits = t([[[0.0, float("-inf"), 0.0]]]).requires_grad_(True)
    out = selective_log_softmax(logits, torch.tensor([[0]]))
    torch.testing.assert_close(out, t([[LN(0.5)]]))
    out.sum().backward()
    torch.testing.assert_close(logits.grad, t([[[0.5, 0.0, -0.5]]]))  # onehot − softmax


def test_selective_log_softmax_shape_error():
    with pytest.raises(ValueError, match="index"):
        selective_log_softmax(torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long))


def test_entropy_from_logits():
    # uniform over V=8 → ln 8; one allowed token (others -inf) → exactly 0, not NaN
    logits = torch.stack([torch.zeros(8), torch.tensor([0.0] + [float("-inf")] * 7)]).unsqueeze(0)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=1), t([[LN(8), 0.0]], torch.float32))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 20, generator=g, requires_grad=True)
    p = F.softmax(x.double(), -1)
    ent = entropy_from_logits(x, chunk_size=2)
    assert not ent.requires_grad  # a statistic for masks and logs
    torch.testing.assert_close(ent.double(), -(p * p.log()).sum(-1), atol=1e-5, rtol=1e-5)
    assert entropy_from_logits(x.bfloat16()).dtype == torch.float32
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(x, chunk_size=0)


# ---------------------------------------------------------------- KL in the reward


def test_kl_reward_penalty():
    # β·Σ(old − ref): row 0 (ln.5 − ln.25) + (ln.25 − ln.25) = ln2, padding (-inf) ignored; row 1 empty → 0
    old = t([[LN(0.5), LN(0.25), float("-inf")], [0.0, 0.0, 0.0]])
    ref = t([[LN(0.25), LN(0.25), float("-inf")], [5.0, 5.0, 5.0]])
    mask = t([[1, 1, 0], [0, 0, 0]])
    torch.testing.assert_close(kl_reward_penalty(old, ref, mask, beta=0.1), t([0.1 * LN(2), 0.0]))


# ---------------------------------------------------------------- filters


def test_overlong_mask():
    mask = t([[1, 1, 0], [1, 1, 1]], torch.float32)
    out = overlong_mask(mask, torch.tensor([False, True]))
    assert torch.equal(out, t([[1, 1, 0], [0, 0, 0]], torch.float32)) and out.dtype == mask.dtype


def test_groups_with_signal():
    # group 0 [1, 0] varies; group 1 [1, 1] equal; group 2 a single sample → no signal
    out = groups_with_signal(t([1, 0, 1, 1, 0.5]), torch.tensor([3, 3, 1, 1, 9]))
    assert out.tolist() == [True, True, False, False, False]


def test_entropy_threshold_quantiles():
    ent = t([[0.1, 0.5, 9.0], [0.3, 0.9, 9.0]])
    mask = t([[1, 1, 0], [1, 1, 0]])  # the 9.0 padding entries are ignored
    # sorted [0.1, 0.3, 0.5, 0.9]; quantile 0.5 → position (1−0.5)·3 = 1.5 → 0.3 + 0.5·(0.5 − 0.3) = 0.4
    assert entropy_threshold(ent, mask, 0.5).item() == pytest.approx(0.4)
    assert entropy_mask(ent, mask, 0.4).tolist() == [[0, 1, 0], [0, 1, 0]]  # top 50%: 0.5 and 0.9
    # quantile 1 keeps every masked token
    assert entropy_mask(ent, mask, entropy_threshold(ent, mask, 1.0)).tolist() == mask.tolist()
    g = torch.Generator().manual_seed(3)
    x, m = torch.rand(4, 30, generator=g), (torch.rand(4, 30, generator=g) > 0.3).float()
    for q in (0.2, 0.37, 0.8):
        expected = torch.quantile(x[m > 0], 1 - q)
        torch.testing.assert_close(entropy_threshold(x, m, q), expected)
    assert entropy_threshold(x, torch.zeros_like(m), 0.2).item() == float("-inf")


@pytest.mark.parametrize("q", [0.0, -0.1, 1.5, float("nan")])
def test_validate_entropy_quantile_rejects(q):
    with pytest.raises(ConfigError, match="--top_entropy_quantile"):
        validate_entropy_quantile(q)


# ---------------------------------------------------------------- rollout importance sampling


def rollout_case():
    # ρ = π_old/π_rollout: row 0 [3, 0.5, pad], row 1 [1.5, pad, pad]
    rollout = t([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    old = t([[LN(3.0), LN(0.5), 7.0], [LN(1.5), 7.0, 7.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    return old, rollout, mask


def test_token_truncate_weights_and_metrics():
    out = rollout_importance_weights(*rollout_case(), mode="token_truncate", threshold=2.0)
    torch.testing.assert_close(out.weights, t([[2.0, 0.5, 0.0], [1.5, 0.0, 0.0]]))  # 0 on padding
    m = {k.removeprefix("rollout_correction/"): v.item() for k, v in out.metrics.items()}
    assert m["clipped_frac"] == pytest.approx(1 / 3)  # ρ = 3 > 2: 1 of 3 trained tokens
    assert m["is_weight_mean"] == pytest.approx(4 / 3)  # (2 + .5 + 1.5)/3
    # ESS: w' = clamp(w, 1/2, 2) = [2, .5, 1.5], mean 4/3 → [1.5, .375, 1.125], mean square 3.65625/3
    assert m["ess"] == pytest.approx(3 / 3.65625, rel=1e-6)


def test_rollout_correction_metrics_as_ms_swift():
    # log ρ = [ln3, ln.5 | ln1.5] (π_rollout's log-probs are 0 here). KL(π_rollout ‖ π_old) estimates:
    #   kl = mean(−log ρ) = −(ln3 + ln.5 + ln1.5)/3 = −ln2.25/3 = −0.27031 (negative: k1 is noisy on 3 tokens)
    #   k3_kl = mean(ρ − ln ρ − 1) = (3 + .5 + 1.5 − 3 − ln2.25)/3 = (2 − ln2.25)/3
    # per-sequence mean log-probs: s_old = [(ln3 + ln.5)/2, ln1.5] = [ln1.5/2, ln1.5], s_rollout = [0, 0]
    #   training_log_ppl = mean(−s_old) = −(ln1.5/2 + ln1.5)/2 = −0.75·ln1.5
    #   training_ppl = mean(exp(−s_old)) = (1/√1.5 + 1/1.5)/2;  rollout_ppl = 1, rollout_log_ppl = 0
    #   log_ppl_diff = mean(s_rollout − s_old) = −0.75·ln1.5, its abs version +0.75·ln1.5
    #   ppl_ratio = mean(exp(s_rollout − s_old)) = (1/√1.5 + 1/1.5)/2
    # chi2_token = mean(ρ²) − 1 = (9 + .25 + 2.25)/3 − 1;  chi2_seq = mean(ρ_seq²) − 1 = (1.5 + 2.25)/2 − 1
    out = rollout_importance_weights(*rollout_case(), mode="token_truncate", threshold=2.0)
    m = {k.removeprefix("rollout_correction/"): v.item() for k, v in out.metrics.items()}
    assert all(k.startswith("rollout_correction/") for k in out.metrics)
    ppl = (1 / math.sqrt(1.5) + 1 / 1.5) / 2
    expected = {
        "kl": -LN(2.25) / 3,
        "k3_kl": (2 - LN(2.25)) / 3,
        "training_log_ppl": -0.75 * LN(1.5),
        "training_ppl": ppl,
        "rollout_ppl": 1.0,
        "rollout_log_ppl": 0.0,
        "log_ppl_diff": -0.75 * LN(1.5),
        "log_ppl_abs_diff": 0.75 * LN(1.5),
        "ppl_ratio": ppl,
        "chi2_token": 11.5 / 3 - 1,
        "chi2_seq": 0.875,
    }
    assert {k: m[k] for k in expected} == pytest.approx(expected, abs=1e-12)
    assert set(m) == {*expected, "is_weight_mean", "ess", "clipped_frac"}


def test_rollout_kl_sign():
    # π_rollout puts more mass than π_old on what it sampled (ρ = 0.5 on each token): KL(π_rollout ‖ π_old) > 0
    old, mask = t([[LN(0.25), LN(0.25)]]), t([[1, 1]])
    out = rollout_importance_weights(old, t([[LN(0.5), LN(0.5)]]), mask, mode="token_truncate", threshold=2.0)
    assert out.metrics["rollout_correction/kl"].item() == pytest.approx(LN(2.0))  # mean(−ln 0.5)
    assert out.metrics["rollout_correction/k3_kl"].item() == pytest.approx(0.5 + LN(2) - 1)  # ρ − ln ρ − 1


def test_token_mask():
    out = rollout_importance_weights(*rollout_case(), mode="token_mask", threshold=2.0)
    torch.testing.assert_close(out.weights, t([[0.0, 0.5, 0.0], [1.5, 0.0, 0.0]]))
    assert out.metrics["rollout_correction/clipped_frac"].item() == pytest.approx(1 / 3)


def test_sequence_modes_use_geometric_mean():
    # ρ_seq: row 0 sqrt(3 · 0.5) = 1.2247, row 1 1.5.  C = 1.3 → row 1 is over the threshold.
    r0 = math.sqrt(1.5)
    trunc = rollout_importance_weights(*rollout_case(), mode="sequence_truncate", threshold=1.3)
    torch.testing.assert_close(trunc.weights, t([[r0, r0, 0.0], [1.3, 0.0, 0.0]]))
    assert trunc.metrics["rollout_correction/clipped_frac"].item() == pytest.approx(1 / 2)
    # sequence_mask keeps the token ratios of kept sequences and drops row 1 entirely
    masked = rollout_importance_weights(*rollout_case(), mode="sequence_mask", threshold=1.3)
    torch.testing.assert_close(masked.weights, t([[3.0, 0.5, 0.0], [0.0, 0.0, 0.0]]))
    assert masked.metrics["rollout_correction/clipped_frac"].item() == pytest.approx(1 / 2)


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_sequence_clipped_frac_counts_every_row(mode):
    # an empty third row (e.g. dropped by --overlong_filter) has ρ_seq = 1 ≤ C and counts as unclipped, as in
    # ms-swift's mean over the batch: 1 of 3 rows over C = 1.3
    old, rollout, mask = rollout_case()
    pad = t([[0.0, 0.0, 0.0]])
    out = rollout_importance_weights(
        torch.cat([old, pad]), torch.cat([rollout, pad]), torch.cat([mask, pad]), mode=mode, threshold=1.3
    )
    assert out.metrics["rollout_correction/clipped_frac"].item() == pytest.approx(1 / 3)


def test_rollout_is_on_policy_and_empty_rows():
    # identical log-probs: every weight 1, ESS 1, nothing clipped, no gap; an all-padding row changes nothing
    old = t([[-1.0, -2.0], [0.0, 0.0]])
    mask = t([[1, 1], [0, 0]])
    for mode in ROLLOUT_IS_MODES:
        out = rollout_importance_weights(old, old.clone(), mask, mode=mode, threshold=2.0)
        torch.testing.assert_close(out.weights, mask)
        m = {k.removeprefix("rollout_correction/"): v.item() for k, v in out.metrics.items()}
        assert m["ess"] == pytest.approx(1.0)
        assert m["clipped_frac"] == 0.0
        assert m["kl"] == 0.0 and m["k3_kl"] == 0.0 and m["chi2_token"] == 0.0 and m["chi2_seq"] == 0.0
        assert m["log_ppl_diff"] == 0.0 and m["ppl_ratio"] == 1.0


def test_rollout_is_validation():
    with pytest.raises(ConfigError, match="--rollout_importance_sampling_mode 'token_clip'"):
        validate_rollout_is_options("token_clip", 2.0)
    with pytest.raises(ConfigError, match="--rollout_importance_sampling_threshold"):
        rollout_importance_weights(*rollout_case(), mode="token_mask", threshold=0.5)
    validate_rollout_is_options(None, 0.0)  # off: nothing to check


# ---------------------------------------------------------------- reference-model EMA


def test_ema_update():
    # α = 0.6: 0.6·3 + 0.4·1 = 2.2;  0.6·0 + 0.4·2 = 0.8
    ref, pol = [t([1.0, 2.0])], [t([3.0, 0.0])]
    ema_update_(ref, pol, alpha=0.6)
    torch.testing.assert_close(ref[0], t([2.2, 0.8]))
    # α = 1 copies the policy exactly; α = 0 leaves the reference alone
    ema_update_(ref, [t([0.1, 0.7])], alpha=1.0)
    assert ref[0].tolist() == [0.1, 0.7]
    ema_update_(ref, [t([5.0, 5.0])], alpha=0.0)
    assert ref[0].tolist() == [0.1, 0.7]


def test_ema_update_mixed_dtype_and_modules():
    ref = torch.nn.Linear(2, 2).to(torch.bfloat16)
    pol = torch.nn.Linear(2, 2)
    ema_update_(ref.parameters(), pol.parameters(), alpha=1.0)
    torch.testing.assert_close(ref.weight.float(), pol.weight.detach().bfloat16().float())
    assert ref.weight.dtype == torch.bfloat16 and ref.weight.requires_grad  # still a trainable-type Parameter


def test_ema_update_errors():
    with pytest.raises(ConfigError, match="--ref_model_mixup_alpha"):
        ema_update_([t([1.0])], [t([1.0])], alpha=1.5)
    with pytest.raises(ConfigError, match="architecture"):
        ema_update_([t([1.0])], [t([1.0]), t([2.0])], alpha=0.5)
    with pytest.raises(ConfigError, match="shape"):
        ema_update_([t([1.0])], [t([1.0, 2.0])], alpha=0.5)
