"""Every loss type × importance-sampling level, as the command line configures it, against the loss written out
independently (``reference_loss``) on synthetic tensors: the loss, every metric and which metrics exist.

These were 19 two-step trainings (tests/integration/test_algorithm_runs.py); the math runs here on tensors shaped
as a trainer's micro-step (varying completion lengths, padding holding -inf, ratios inside and outside the clip
range, positive and negative advantages, a reference that differs from the policy). Three trainer runs there keep
checking that the trainer hands its real tensors to this same function.
"""

from __future__ import annotations

import pytest
import torch

from grpokit.algorithms import LossInputs, compute_policy_loss

COMBOS = [
    (loss, level)
    for loss in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
    for level in ("token", "sequence", "sequence_token")
] + [("sapo", "token"), ("sapo", "sequence"), ("luspo", "sequence"), ("vespo", "token")]
CLIP_KEYS = {
    "cispo": {"cispo_clip_ratio"},  # only the upper cap clips (TRL's and ms-swift's name)
    "sapo": set(),  # sapo gates softly and clips nothing
    "vespo": {"vespo/phi_seq_mean"},
}  # vespo weighs whole sequences instead of clipping
PPO_CLIP_KEYS = {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}
MAX_COMPLETION_LENGTH = 8


def reference_loss(cfg, step: dict) -> tuple[float, dict[str, float]]:
    """One micro-step's loss and metrics from its tensors, written out per loss type and level (grpokit/algorithms/
    losses.py's docstring) for one process and one micro-step per optimizer step."""
    mask = step["mask"]
    keep = mask > 0
    lp, old, ref = (torch.where(keep, step[k], 0.0) for k in ("logps", "old", "ref"))
    adv = step["adv"][:, None]
    n = mask.sum(1)
    if cfg.importance_sampling_level == "token":
        r = torch.exp(lp - old)
    else:  # sequence ([B, 1]) and sequence_token ([B, T]): the value is exp(mean token log ratio) of the sequence
        r = torch.exp(((lp - old) * mask).sum(1) / n.clamp(min=1))[:, None]
        r = r if cfg.importance_sampling_level == "sequence" else r.expand_as(lp)
    logged = {}
    if cfg.loss_type == "cispo":
        per_token = -torch.clamp(r, max=cfg.epsilon_high) * adv * lp
        logged["cispo_clip_ratio"] = (r > cfg.epsilon_high) & (adv > 0)
    elif cfg.loss_type == "vespo":  # φ(W) = e^λ·W^k·e^(−λW), W = Π_t r_t of the sequence; (k, λ) by the sign of A
        log_w = ((lp - old) * mask).sum(1, keepdim=True)
        k = torch.where(adv >= 0, cfg.vespo_k_pos, cfg.vespo_k_neg)
        lam = torch.where(adv >= 0, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        per_token = -phi * adv * lp
        logged["vespo/phi_seq_mean"] = phi  # [B, 1]
    elif cfg.loss_type == "sapo":
        tau = torch.where(adv > 0, cfg.tau_pos, cfg.tau_neg)
        per_token = -torch.sigmoid(tau * (r - 1)) * 4 / tau * adv
    else:
        per_token = -torch.min(r * adv, torch.clamp(r, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high) * adv)
        low, high = (r < 1 - cfg.epsilon_low) & (adv < 0), (r > 1 + cfg.epsilon_high) & (adv > 0)
        logged = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low | high}
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    per_token = (per_token + cfg.beta * kl) * mask
    if cfg.loss_type in ("grpo", "sapo"):  # per-sequence mean, then batch mean
        loss = (per_token.sum(1) / n.clamp(min=1)).mean()
    elif cfg.loss_type == "dr_grpo":  # a constant: batch size × max completion length
        loss = per_token.sum() / (len(mask) * cfg.max_completion_length)
    elif cfg.loss_type == "luspo":  # each sequence's loss × its length, mean over the batch
        loss = per_token.sum() / len(mask)
    else:  # bnpo: the micro-batch's tokens; dapo, cispo, vespo: the optimizer step's tokens, the same here
        loss = per_token.sum() / mask.sum()

    def mean(x: torch.Tensor) -> float:
        return float((x.float() * mask).sum() / mask.sum())

    def ratio_mean(x: torch.Tensor) -> float:
        """A value per sequence ([B, 1]: the sequence-level ratio and its clip decisions, vespo's φ) is averaged
        over the sequences (TRL's global_masked_mean); a per-token value ([B, T]) over the trained tokens."""
        return float(x.float().mean()) if x.shape[1] == 1 else mean(x)

    return float(loss), {
        "is_ratio/mean": ratio_mean(r),
        "kl": mean(kl),
        **{k: ratio_mean(v) for k, v in logged.items()},
    }


def micro_step(seed: int, off_policy: bool) -> dict:
    """A micro-step's tensors: 8 completions of lengths 1..8 (T = 8), padding holding -inf, advantages of both
    signs (two zero). Off policy, the current log-probs moved by up to ±0.6 per token from the rollout's, so some
    ratios leave every clip range; on policy they equal the rollout's and the reference's."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randperm(8, generator=g) + 1
    mask = (torch.arange(8)[None, :] < lengths[:, None]).float()
    old = -torch.rand(8, 8, generator=g) * 3 - 0.05
    shift = (torch.rand(8, 8, generator=g) - 0.5) * 1.2 if off_policy else torch.zeros(8, 8)
    logps = old + shift
    ref = old + (torch.rand(8, 8, generator=g) - 0.5) * 0.4 if off_policy else old.clone()
    pad = mask == 0
    adv = torch.tensor([1.5, -1.0, 0.5, -0.5, 2.0, -2.0, 0.0, 0.0])[torch.randperm(8, generator=g)]
    return {
        "logps": logps.masked_fill(pad, float("-inf")),
        "old": old.masked_fill(pad, float("-inf")),
        "ref": ref.masked_fill(pad, float("-inf")),
        "adv": adv,
        "mask": mask,
    }


def loss_config_from_cli(tiny_model_dir, loss_type: str, level: str):
    from grpokit.algorithms.option_checks import loss_config
    from grpokit.config.parse import parse_train_args

    cfg = parse_train_args(
        [
            "--model",
            str(tiny_model_dir),
            "--dataset",
            "builtin:arithmetic",
            "--loss_type",
            loss_type,
            "--importance_sampling_level",
            level,
            "--beta",
            "0.04",
            "--max_completion_length",
            str(MAX_COMPLETION_LENGTH),
        ]
    )
    return loss_config(cfg)


@pytest.mark.parametrize("loss_type, level", COMBOS)
def test_every_loss_and_level_matches_its_formula(tiny_model_dir, loss_type, level):
    """The command line's loss type and level reach the loss; off policy, loss and metrics equal the formula's;
    its clip metrics (and only those) are reported; on policy the ratio is 1 and the KL 0; gradients are finite
    and reach only trained tokens."""
    cfg = loss_config_from_cli(tiny_model_dir, loss_type, level)
    assert (cfg.loss_type, cfg.importance_sampling_level, cfg.beta) == (loss_type, level, 0.04)
    assert cfg.max_completion_length == MAX_COMPLETION_LENGTH
    clip_keys = CLIP_KEYS.get(loss_type, PPO_CLIP_KEYS)
    clipped = []
    for seed in (0, 1):
        step = micro_step(seed, off_policy=True)
        logps = step["logps"].clone().requires_grad_(True)
        out = compute_policy_loss(
            LossInputs(
                logps=logps,
                old_logps=step["old"],
                advantages=step["adv"],
                mask=step["mask"],
                ref_logps=step["ref"],
                num_items=float(step["mask"].sum()),
            ),
            cfg,
        )
        loss, metrics = reference_loss(cfg, step)
        assert float(out.loss) == pytest.approx(loss, rel=1e-5, abs=1e-7)
        assert set(out.metrics) == set(metrics) == {"is_ratio/mean", "kl", *clip_keys}
        for key, value in metrics.items():
            assert float(out.metrics[key]) == pytest.approx(value, rel=1e-5, abs=1e-7), key
        out.loss.backward()
        assert torch.isfinite(logps.grad).all() and (logps.grad[step["mask"] == 0] == 0).all()
        assert logps.grad.abs().sum() > 0
        clipped.append(float(out.metrics.get("clip_ratio/region_mean", 0.0)))
    if clip_keys == PPO_CLIP_KEYS:  # the synthetic ratios do leave the clip range, so clipping is exercised
        assert max(clipped) > 0
    on = micro_step(0, off_policy=False)
    out = compute_policy_loss(
        LossInputs(
            logps=on["logps"],
            old_logps=on["old"],
            advantages=on["adv"],
            mask=on["mask"],
            ref_logps=on["ref"],
            num_items=float(on["mask"].sum()),
        ),
        cfg,
    )
    assert float(out.metrics["is_ratio/mean"]) == pytest.approx(1.0, abs=1e-6)  # ratio 1 before any update
    assert float(out.metrics["kl"]) == pytest.approx(0.0, abs=1e-7)  # the policy is the reference
