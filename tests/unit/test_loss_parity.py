"""compute_policy_loss against plain-torch transcriptions of TRL's GRPOTrainer._compute_loss (float64, 1e-6), and
the teacher's per-token advantage (algorithms/distill.py) against ms-swift's OPD-RL formula.

Each ``trl_*`` function below restates, in its own few lines, the formula TRL's ``_compute_loss`` computes for
one loss type (trl/trainer/grpo_trainer.py); none of it calls grpokit. The batch has padding, mixed-sign
advantages and ratios on both sides of the clip range, so every branch of the formulas is exercised; padding
holds finite values because TRL's formulas multiply by the mask (a -inf there would give NaN in TRL too).
"""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algorithms import LossConfig, LossInputs, compute_policy_loss
from grpokit.algorithms.distill import distill_advantages

B, T, MAX_LEN = 4, 5, 6
TOL = {"atol": 1e-6, "rtol": 1e-6}


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.05  # [B, T]
    old = logps + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)  # ratios in e^±0.5
    ref = logps + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.6
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float64)
    ent = (torch.rand(B, T, generator=g) > 0.4).to(torch.float64) * mask  # high-entropy tokens
    adv = torch.tensor([0.9, -1.3, 0.4, -0.2], dtype=torch.float64)
    return {"logps": logps, "old": old, "ref": ref, "mask": mask, "ent": ent, "adv": adv}


def grpokit_loss(d: dict, cfg: LossConfig, entropy: bool = False, num_items: float = 11.0):
    logps = d["logps"].clone().requires_grad_(True)
    inp = LossInputs(
        logps=logps,
        old_logps=d["old"],
        advantages=d["adv"],
        mask=d["mask"],
        ref_logps=d["ref"] if cfg.beta else None,
        num_items=num_items,
        entropy_mask=d["ent"] if entropy else None,
    )
    out = compute_policy_loss(inp, cfg)
    return out, torch.autograd.grad(out.loss, logps)[0]


def reference_grad(fn, d: dict, **kw):
    logps = d["logps"].clone().requires_grad_(True)
    loss = fn({**d, "logps": logps}, **kw)
    return loss, torch.autograd.grad(loss, logps)[0]


def trl_normalise(per_token, mask, loss_type, num_items):
    """TRL's aggregation of a [B, T] (or [B, 1], broadcast) per-token loss, one optimizer micro-step."""
    per_token = per_token * mask
    if loss_type in ("grpo", "sapo"):
        return (per_token.sum(1) / mask.sum(1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return per_token.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return per_token.sum() / (mask.shape[0] * MAX_LEN)
    return per_token.sum() / num_items  # dapo, cispo, vespo: num_items_in_batch / num_processes


def trl_k3(logps, ref):
    return torch.exp(ref - logps) - (ref - logps) - 1


def trl_ppo_clip(d, loss_type, beta, entropy, num_items=11.0, eps=0.2):
    """Token level: -min(r·A, clip(r)·A) × entropy mask, then + β·k3 (unmasked), then the loss type's aggregation."""
    a = d["adv"].unsqueeze(1)
    r = torch.exp(d["logps"] - d["old"])
    policy = -torch.minimum(r * a, torch.clamp(r, 1 - eps, 1 + eps) * a)
    if entropy:
        policy = policy * d["ent"]
    return trl_normalise(policy + beta * trl_k3(d["logps"], d["ref"]), d["mask"], loss_type, num_items)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_entropy_mask_masks_policy_term_not_kl(loss_type, beta):
    d = make_batch()
    out, grad = grpokit_loss(d, LossConfig(loss_type=loss_type, beta=beta, max_completion_length=MAX_LEN), entropy=True)
    want, want_grad = reference_grad(trl_ppo_clip, d, loss_type=loss_type, beta=beta, entropy=True)
    torch.testing.assert_close(out.loss, want, **TOL)
    torch.testing.assert_close(grad, want_grad, **TOL)
    # the β·KL gradient reaches tokens the entropy mask drops
    dropped = (d["mask"] > 0) & (d["ent"] == 0)
    assert dropped.any() and (grad[dropped] != 0).any() == (beta != 0)


def trl_ratio(d, level):
    """TRL's coef_1: exp of the token log-ratio, or of its masked mean per sequence ([B, 1])."""
    log_ratio = d["logps"] - d["old"]
    if level == "sequence":
        log_ratio = ((log_ratio * d["mask"]).sum(-1) / d["mask"].sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return torch.exp(log_ratio)


def trl_sapo(d, level, beta, entropy, tau_pos=1.0, tau_neg=1.05):
    """−σ(τ(r−1))·4/τ·A with τ by the sign of A, at either level; × entropy mask, + β·k3, grpo aggregation."""
    a = d["adv"].unsqueeze(1)
    tau = torch.where(a > 0, tau_pos, tau_neg).to(torch.float64)
    policy = -torch.sigmoid(tau * (trl_ratio(d, level) - 1)) * 4 / tau * a
    if entropy:
        policy = policy * d["ent"]
    return trl_normalise(policy + beta * trl_k3(d["logps"], d["ref"]), d["mask"], "sapo", None)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta, entropy", [(0.0, False), (0.3, True)])
def test_sapo_matches_trl_at_both_levels(level, beta, entropy):
    d = make_batch(1)
    out, grad = grpokit_loss(
        d, LossConfig(loss_type="sapo", importance_sampling_level=level, beta=beta), entropy=entropy
    )
    want, want_grad = reference_grad(trl_sapo, d, level=level, beta=beta, entropy=entropy)
    torch.testing.assert_close(out.loss, want, **TOL)
    torch.testing.assert_close(grad, want_grad, **TOL)


def trl_luspo(d, delta=None, eps=0.2):
    """Sequence level: PPO clip of the [B, 1] ratio (δ-capped first term), × each sequence's length, mean over B."""
    a = d["adv"].unsqueeze(1)
    r = trl_ratio(d, "sequence")  # [B, 1]
    first = r if delta is None else torch.clamp(r, max=delta)
    per_seq = -torch.minimum(first * a, torch.clamp(r, 1 - eps, 1 + eps) * a)  # [B, 1]
    return (per_seq * d["mask"].sum(1, keepdim=True)).mean()


@pytest.mark.parametrize("seed", [0, 2])
@pytest.mark.parametrize("delta", [None, 1.25])
def test_luspo_matches_trl_in_the_papers_setup(seed, delta):
    # sequence ratios: seed 0 [1.16, 0.90, 0.73, 0.83], seed 2 [0.84, 1.17, 1.60, 1.01]. With these advantages
    # seed 0 clips row 2 from below (A < 0, r < 0.8); seed 2 clips row 2 at 1.2 and, with δ = 1.25, caps its
    # unclipped term (A < 0, r > δ)
    d = {**make_batch(seed), "adv": torch.tensor([0.9, -1.3, -0.4, 0.2], dtype=torch.float64)}
    out, grad = grpokit_loss(d, LossConfig(loss_type="luspo", importance_sampling_level="sequence", delta=delta))
    want, want_grad = reference_grad(trl_luspo, d, delta=delta)
    torch.testing.assert_close(out.loss, want, **TOL)
    torch.testing.assert_close(grad, want_grad, **TOL)


def trl_vespo(d, beta, entropy, is_ratio=None, num_items=11.0, k=(2.0, 3.0), lam=(3.0, 2.0)):
    """TRL's get_gamma_weights (product ratio W, optional token IS ratio folded in log space, Gamma kernel by the
    sign of A, all without gradient), then −φ·A·log π × entropy mask + β·k3 over the global token count."""
    a = d["adv"].unsqueeze(1)
    with torch.no_grad():
        floor = math.log(1e-8)
        seq = (torch.clamp(d["logps"] - d["old"], -20, 20) * d["mask"]).sum(-1, keepdim=True)
        if is_ratio is not None:  # TRL's ratio is 1 on padding: its log adds nothing there
            seq = seq + torch.clamp(torch.log(is_ratio), floor, 20).sum(-1, keepdim=True)
        log_w = torch.clamp(seq, floor, 20)
        k_ = torch.where(a >= 0, k[0], k[1]).to(torch.float64)
        lam_ = torch.where(a >= 0, lam[0], lam[1]).to(torch.float64).clamp(min=1e-4)
        phi = torch.exp(lam_ + k_ * log_w - lam_ * torch.exp(log_w)).nan_to_num(0.0, 0.0, 0.0)
    policy = -phi * a * d["logps"]
    if entropy:
        policy = policy * d["ent"]
    return trl_normalise(policy + beta * trl_k3(d["logps"], d["ref"]), d["mask"], "vespo", num_items)


def test_vespo_matches_trl_with_entropy_mask_and_kl():
    d = make_batch(3)
    out, grad = grpokit_loss(d, LossConfig(loss_type="vespo", beta=0.3), entropy=True)
    want, want_grad = reference_grad(trl_vespo, d, beta=0.3, entropy=True)
    torch.testing.assert_close(out.loss, want, **TOL)
    torch.testing.assert_close(grad, want_grad, **TOL)


@pytest.mark.parametrize("k, lam", [((2.0, 3.0), (3.0, 2.0)), ((0.5, 4.0), (1.5, 0.0))])
def test_vespo_matches_trl_with_token_rollout_weights(k, lam):
    # token_truncate/token_mask weights: one truncated at C = 1.2, one masked to 0. grpokit's weights are 0 on
    # padding (rollout_importance_weights), TRL's are 1 there; both mean "no factor". λ_neg = 0 meets the 1e-4
    # floor (validate_loss_config refuses it; the loss itself follows TRL).
    d = make_batch(4)
    g = torch.Generator().manual_seed(5)
    w = torch.clamp(torch.exp((torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 0.8), max=1.2)
    w[1, 2] = 0.0  # masked by token_mask
    logps = d["logps"].clone().requires_grad_(True)
    cfg = LossConfig(
        loss_type="vespo", vespo_k_pos=k[0], vespo_k_neg=k[1], vespo_lambda_pos=lam[0], vespo_lambda_neg=lam[1]
    )
    out = compute_policy_loss(
        LossInputs(
            logps=logps,
            old_logps=d["old"],
            advantages=d["adv"],
            mask=d["mask"],
            rollout_is_weights=w * d["mask"],
            num_items=11.0,
        ),
        cfg,
    )
    grad = torch.autograd.grad(out.loss, logps)[0]
    trl_w = torch.where(d["mask"] > 0, w, 1.0)
    want, want_grad = reference_grad(trl_vespo, d, beta=0.0, entropy=False, is_ratio=trl_w, k=k, lam=lam)
    torch.testing.assert_close(out.loss, want, **TOL)
    torch.testing.assert_close(grad, want_grad, **TOL)


# ms-swift's expand_advantage_to_per_token / compute_teacher_kl_per_token, restated in our own words (no
# ms-swift code runs here): the base advantage broadcast over the completion frame, plus coef × the masked
# teacher-minus-old-student log-ratio; the k3 gauge masks the ratio before exp, then sums over the mask / count.
def swift_per_token_advantage(adv, teacher, old, mask, coef):
    signed = (teacher - old).masked_fill(~mask.bool(), 0.0)
    return adv.unsqueeze(1).expand_as(mask).clone() + coef * signed


def swift_teacher_kl(teacher, old, mask):
    d = (teacher - old).masked_fill(~mask.bool(), 0.0)
    k3 = torch.exp(d) - d - 1
    return (k3.sum() / mask.sum().clamp(min=1.0)).item()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("coef", [1.0, 0.3])
def test_teacher_advantage_matches_ms_swift(seed, coef):
    d = make_batch(seed)
    g = torch.Generator().manual_seed(seed + 10)
    teacher = d["old"] + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 4  # log-ratios in ±2
    out = distill_advantages(d["adv"], teacher, d["old"], d["mask"], coef)
    want = swift_per_token_advantage(d["adv"], teacher, d["old"], d["mask"], coef)
    torch.testing.assert_close(out.advantages, want, **TOL)
    assert out.metrics["teacher_kl"] == pytest.approx(swift_teacher_kl(teacher, d["old"], d["mask"]), abs=1e-6)
    # and through the loss: ms-swift's clipped objective takes the [B, T] advantages as they are
    got, grad = grpokit_loss({**d, "adv": out.advantages}, LossConfig(loss_type="grpo", beta=0.0))
    want_loss, want_grad = reference_grad(swift_ppo_clip_per_token, {**d, "adv": want})
    torch.testing.assert_close(got.loss, want_loss, **TOL)
    torch.testing.assert_close(grad, want_grad, **TOL)


def swift_ppo_clip_per_token(d, eps=0.2):
    """−min(r·A_t, clip(r)·A_t) with per-token advantages [B, T], then the grpo aggregation."""
    r = torch.exp(d["logps"] - d["old"])
    policy = -torch.minimum(r * d["adv"], torch.clamp(r, 1 - eps, 1 + eps) * d["adv"])
    return trl_normalise(policy, d["mask"], "grpo", None)
