"""Off-policy sequence masking (--off_policy_sequence_mask_delta, grpokit/algorithms/off_policy_mask.py): which
sequences a hand-worked batch masks, that a masked sequence gets no policy gradient while the others keep theirs,
the trainer's wiring (engine logprobs first, old logps where the engine has none) and the option's parsing."""

from __future__ import annotations

import pytest
import torch

from grpokit.algorithms import LossConfig, LossInputs, compute_policy_loss, off_policy_sequence_mask
from grpokit.config.args import AlgorithmArguments
from grpokit.config.parse import parse_train_args
from grpokit.errors import ConfigError
from grpokit.trainers.batch import RolloutBatch
from grpokit.trainers.policy_loss import policy_loss

NAN = float("nan")
DELTA = 0.5


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def batch() -> dict:
    """Six rows, T = 3, δ = 0.5. Every number is a multiple of 1/8, so the means are exact. The divergence of a
    row is the mean over its trained tokens of behaviour − current, behaviour = engine logp, or the old logp where
    the engine's is NaN.

    row  A   mask     current        engine (rollout)      old            divergence          masked?
    0   +1   1 1 0   -1   -2   0    0     -1    0         -1   -2   0    (1 + 1)/2 = 1       no: A > 0
    1   -1   1 1 0   -1   -2   0    -0.25 -0.75 0         -1   -2   0    (0.75 + 1.25)/2 = 1 yes
    2   -1   1 1 0   -1   -2   0    -0.25 -2.5  49        -1   -2   0    (0.75 − 0.5)/2 = 0.125  no (one token
                                                                         is above δ, the mean is not; padding out)
    3   -1   1 1 0   -2   -1   0    NaN   -0.5  0         -2   -0.5 0    (0 + 0.5)/2 = 0.25  no (a NaN read as 0
                                                                         would give (2 + 0.5)/2 = 1.25: masked)
    4   -1   1 1 0   -1   -2   0    NaN   NaN   NaN       0    -1   0    (1 + 1)/2 = 1       yes (old: the policy
                                                                         moved away; NaN kept would mask nothing)
    5   -1   0 0 0   -1   -2   0    4     3     0         -1   -2   0    no trained token    no
    """
    cur = t([[-1, -2, 0], [-1, -2, 0], [-1, -2, 0], [-2, -1, 0], [-1, -2, 0], [-1, -2, 0]])
    rollout = t([[0, -1, 0], [-0.25, -0.75, 0], [-0.25, -2.5, 49], [NAN, -0.5, 0], [NAN, NAN, NAN], [4, 3, 0]])
    old = t([[-1, -2, 0], [-1, -2, 0], [-1, -2, 0], [-2, -0.5, 0], [0, -1, 0], [-1, -2, 0]])
    mask = t([[1, 1, 0]] * 5 + [[0, 0, 0]])
    adv = t([1, -1, -1, -1, -1, -1])
    return {"logps": cur, "rollout": rollout, "old": old, "mask": mask, "adv": adv}


KEPT = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]


def test_hand_worked_rows():
    b = batch()
    seq_mask, metrics = off_policy_sequence_mask(b["logps"], b["old"], b["adv"], b["mask"], DELTA, b["rollout"])
    assert seq_mask.tolist() == KEPT
    assert metrics["off_policy_mask/masked_ratio"].item() == pytest.approx(2 / 6)  # every row counts
    assert metrics["off_policy_mask/kl_mean"].item() == pytest.approx((1 + 1 + 0.125 + 0.25 + 1) / 5)  # not row 5


def test_per_token_advantages_and_the_threshold_itself():
    b = batch()
    per_token = b["adv"].unsqueeze(1).expand(-1, 3).clone()
    per_token[5] = 7.0  # padding of an empty row is never read
    seq_mask, _ = off_policy_sequence_mask(b["logps"], b["old"], per_token, b["mask"], DELTA, b["rollout"])
    assert seq_mask.tolist() == KEPT
    # rows 1 and 4 sit exactly at divergence 1: "greater than δ" keeps them at δ = 1
    seq_mask, metrics = off_policy_sequence_mask(b["logps"], b["old"], b["adv"], b["mask"], 1.0, b["rollout"])
    assert seq_mask.tolist() == [1.0] * 6 and metrics["off_policy_mask/masked_ratio"].item() == 0


def test_without_engine_logprobs_the_old_logps_are_the_behaviour_policy():
    # rows 0-3 have old == current (divergence 0), row 4 has old = current + 1: only row 4 is masked
    b = batch()
    seq_mask, _ = off_policy_sequence_mask(b["logps"], b["old"], b["adv"], b["mask"], DELTA)
    assert seq_mask.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    # on-policy without engine logprobs (old = current): nothing to compare, nothing masked
    seq_mask, metrics = off_policy_sequence_mask(b["logps"], b["logps"], b["adv"], b["mask"], 0.0)
    assert seq_mask.tolist() == [1.0] * 6 and metrics["off_policy_mask/kl_mean"].item() == 0


def test_an_empty_batch_and_a_negative_delta():
    empty = torch.zeros(2, 3)
    seq_mask, metrics = off_policy_sequence_mask(empty, empty, -torch.ones(2), empty, 0.0)
    assert seq_mask.tolist() == [1.0, 1.0] and all(v.item() == 0 for v in metrics.values())
    with pytest.raises(ConfigError, match="--off_policy_sequence_mask_delta -0.1: must be ≥ 0"):
        off_policy_sequence_mask(empty, empty, -torch.ones(2), empty, -0.1)


def _loss_and_grad(b: dict, cfg: LossConfig, seq_mask=None, adv=None, ref=None):
    logps = b["logps"].clone().requires_grad_(True)
    out = compute_policy_loss(
        LossInputs(
            logps=logps,
            old_logps=b["old"],
            advantages=b["adv"] if adv is None else adv,
            mask=b["mask"],
            ref_logps=ref,
            num_items=10.0,
            sequence_mask=seq_mask,
        ),
        cfg,
    )
    out.loss.backward()
    return out.loss, logps.grad


@pytest.mark.parametrize(
    "loss_type, level",
    [("grpo", "token"), ("bnpo", "token"), ("dapo", "token"), ("cispo", "token"), ("grpo", "sequence")],
)
def test_masked_rows_get_no_gradient_and_kept_rows_the_same(loss_type, level):
    b = batch()
    cfg = LossConfig(
        loss_type=loss_type, importance_sampling_level=level, epsilon_high=5.0 if loss_type == "cispo" else 0.2
    )
    seq_mask, _ = off_policy_sequence_mask(b["logps"], b["old"], b["adv"], b["mask"], DELTA, b["rollout"])
    loss, grad = _loss_and_grad(b, cfg, seq_mask)
    _, plain = _loss_and_grad(b, cfg)
    masked = torch.tensor(KEPT) == 0
    assert grad[masked].abs().sum() == 0 and plain[masked].abs().sum() > 0
    assert torch.equal(grad[~masked], plain[~masked])  # the normaliser keeps the masked rows' tokens
    # with β = 0, masking a sequence is the same as giving it advantage 0
    zeroed, _ = _loss_and_grad(b, cfg, adv=b["adv"] * torch.tensor(KEPT, dtype=torch.float64))
    assert loss.item() == pytest.approx(zeroed.item(), abs=1e-12)


def test_masked_rows_keep_their_kl_term():
    b = batch()
    cfg = LossConfig(beta=0.1)
    seq_mask = t(KEPT)
    ref = b["logps"] - 0.5
    _, grad = _loss_and_grad(b, cfg, seq_mask, ref=ref)
    _, kl_only = _loss_and_grad(b, cfg, seq_mask, adv=torch.zeros(6, dtype=torch.float64), ref=ref)
    masked = torch.tensor(KEPT) == 0
    assert kl_only[masked].abs().sum() > 0 and torch.equal(grad[masked], kl_only[masked])


def _rollout_batch(b: dict, rollout=True) -> RolloutBatch:
    n, c = b["mask"].shape
    ids = torch.zeros(n, c + 1, dtype=torch.long)
    return RolloutBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        position_ids=ids,
        completion_mask=b["mask"],
        truncated=torch.zeros(n, dtype=torch.bool),
        advantages=b["adv"],
        old_logps=b["old"],
        rollout_logps=b["rollout"] if rollout else None,
    )


def test_policy_loss_applies_the_mask_and_logs_it():
    b = batch()
    logps = b["logps"].clone().requires_grad_(True)
    cfg = LossConfig()
    args = AlgorithmArguments(off_policy_sequence_mask_delta=DELTA)
    loss, metrics = policy_loss(logps, None, _rollout_batch(b), args, cfg, None)
    expected, _ = _loss_and_grad(b, cfg, t(KEPT))
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)
    assert metrics["off_policy_mask/masked_ratio"].item() == pytest.approx(2 / 6)


@pytest.mark.parametrize("rollout", [True, False])
def test_policy_loss_without_the_option_is_unchanged(rollout):
    """delta unset: the loss is the one without any sequence mask, bit for bit, and nothing is logged for it; a
    delta no row reaches multiplies every row by 1, which changes no bit either."""
    b = batch()
    cfg = LossConfig(beta=0.0)
    plain, plain_grad = _loss_and_grad(b, cfg)
    for delta in (None, 1e9):
        logps = b["logps"].clone().requires_grad_(True)
        loss, metrics = policy_loss(
            logps, None, _rollout_batch(b, rollout), AlgorithmArguments(off_policy_sequence_mask_delta=delta), cfg, None
        )
        loss.backward()
        assert torch.equal(loss, plain) and torch.equal(logps.grad, plain_grad)
        assert any(k.startswith("off_policy_mask/") for k in metrics) is (delta is not None)


BASE = ["--model", "m/m", "--dataset", "d.jsonl"]


def test_the_option_parses_and_refuses_a_negative_delta():
    assert parse_train_args(BASE).algorithm.off_policy_sequence_mask_delta is None
    assert (
        parse_train_args(BASE + ["--off_policy_sequence_mask_delta", "0.3"]).algorithm.off_policy_sequence_mask_delta
        == 0.3
    )
    with pytest.raises(ConfigError) as e:
        parse_train_args(BASE + ["--off_policy_sequence_mask_delta", "-1"])
    assert str(e.value) == "--off_policy_sequence_mask_delta -1.0: must be ≥ 0 (unset: no mask)"


def test_the_option_is_refused_with_the_real_loss():
    with pytest.raises(
        ConfigError,
        match="--off_policy_sequence_mask_delta 0.1 masks sequences out of a per-token "
        "policy term, which --loss_type real does not have",
    ):
        parse_train_args(
            BASE
            + ["--loss_type", "real", "--per_device_train_batch_size", "8", "--off_policy_sequence_mask_delta", "0.1"]
        )
