"""compute_policy_loss against plain-torch transcriptions of TRL's GRPOTrainer._compute_loss (float64, 1e-6).

Each ``trl_*`` function below restates, in its own few lines, the formula TRL's ``_compute_loss`` computes for
one loss type (trl/trainer/grpo_trainer.py); none of it calls grpokit. The batch has padding, mixed-sign
advantages and ratios on both sides of the clip range, so every branch of the formulas is exercised; padding
holds finite values because TRL's formulas multiply by the mask (a -inf there would give NaN in TRL too).
"""

from __future__ import annotations

import pytest
import torch

from grpokit.algorithms import LossConfig, LossInputs, compute_policy_loss

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
    inp = LossInputs(logps=logps, old_logps=d["old"], advantages=d["adv"], mask=d["mask"],
                     ref_logps=d["ref"] if cfg.beta else None, num_items=num_items,
                     entropy_mask=d["ent"] if entropy else None)
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
    out, grad = grpokit_loss(d, LossConfig(loss_type=loss_type, beta=beta, max_completion_length=MAX_LEN),
                             entropy=True)
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
    out, grad = grpokit_loss(d, LossConfig(loss_type="sapo", importance_sampling_level=level, beta=beta),
                             entropy=entropy)
    want, want_grad = reference_grad(trl_sapo, d, level=level, beta=beta, entropy=entropy)
    torch.testing.assert_close(out.loss, want, **TOL)
    torch.testing.assert_close(grad, want_grad, **TOL)

