"""Advantage estimators and scale modes against hand-worked values, and the vectorised code against a plain loop."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections import defaultdict

import pytest
import torch

from grpokit.algorithms import (
    ADVANTAGE_ESTIMATORS,
    DEFAULT_SCALE,
    SCALE_MODES,
    compute_advantages,
    validate_advantage_options,
)
from grpokit.errors import ConfigError, RewardError, RolloutError

NAN = float("nan")
EPS = 1e-4


def t(x, dtype=torch.float64):
    return torch.tensor(x, dtype=dtype)


def ids(x):
    return torch.tensor(x, dtype=torch.long)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, t(expected, actual.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------- hand-worked values


def test_grpo_group_nan_reward_equal_group_and_singleton():
    # Two functions, weights [1, 0.5]; the second skips sample 2 (NaN → left out of the sum).
    # group 0: rewards = [1+0.5, 0+0.5, 1, 0+0] = [1.5, 0.5, 1.0, 0.0]; mean 0.75
    #   deviations [0.75, -0.25, 0.25, -0.75]; Σd² = 1.25; Bessel std = sqrt(1.25/3)
    # group 5: [1, 1] all equal → 0;  group 9: a single sample → 0
    rpf = t([[1, 1], [0, 1], [1, NAN], [0, 0], [1, 0], [1, 0], [0.3, 0.4]])
    out = compute_advantages(rpf, t([1.0, 0.5]), ids([0, 0, 0, 0, 5, 5, 9]))
    s = math.sqrt(1.25 / 3) + EPS
    close(out.advantages, [0.75 / s, -0.25 / s, 0.25 / s, -0.75 / s, 0, 0, 0])
    close(out.rewards, [1.5, 0.5, 1.0, 0.0, 1.0, 1.0, 0.5])
    assert torch.isfinite(out.advantages).all()
    # 2 of 3 groups have zero std (the equal pair and the singleton)
    assert out.metrics["frac_reward_zero_std"] == pytest.approx(2 / 3)
    # reward/mean over the 7 trajectories: (1.5+.5+1+0+1+1+.5)/7 = 5.5/7
    assert out.metrics["reward/mean"] == pytest.approx(5.5 / 7)
    # reward/std: mean of the group stds (sqrt(1.25/3), 0, 0)
    assert out.metrics["reward/std"] == pytest.approx(math.sqrt(1.25 / 3) / 3)


def test_equal_rewards_give_exactly_zero():
    # 0.1 three times: a plain sum/3 leaves a rounding residue that /(0 + 1e-4) would magnify; the group's own
    # value is subtracted first, so the mean is exactly 0.1 and the advantage exactly 0.
    for dtype in (torch.float32, torch.float64):
        out = compute_advantages(torch.full((3, 1), 0.1, dtype=dtype), t([1.0]), ids([4, 4, 4]))
        assert torch.equal(out.advantages, torch.zeros(3, dtype=dtype))
        assert out.metrics["frac_reward_zero_std"] == 1.0


def test_grpo_batch_scale():
    # groups [0,0 | 1,1], rewards [1,0 | 1,1]: centred [0.5, -0.5, 0, 0]
    # batch std of the rewards: mean 0.75, Σd² = .0625+.5625+.0625+.0625 = .75, /3 → std 0.5
    out = compute_advantages(t([[1], [0], [1], [1]]), t([1.0]), ids([0, 0, 1, 1]), scale="batch")
    close(out.advantages, [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0, 0])
    assert out.metrics["reward/batch_std"] == pytest.approx(0.5)


def test_grpo_no_scale_dr_grpo():
    # Dr. GRPO: reward minus group mean, nothing else. groups [0,0,0 | 1], rewards [3,0,0 | 7]: mean 1
    out = compute_advantages(t([[3], [0], [0], [7]]), t([1.0]), ids([2, 2, 2, 8]), scale="none")
    close(out.advantages, [2, -1, -1, 0])


def test_rloo_leave_one_out():
    # group [1, 0, 0] (K=3, mean 1/3): (r - 1/3)·3/2 = [1, -0.5, -0.5]
    #   check: 1 - mean(0,0) = 1;  0 - mean(1,0) = -0.5
    # group [2, 0] (K=2, mean 1): (r - 1)·2 = [2, -2];  group of one → 0 (no other sample)
    out = compute_advantages(t([[1], [0], [0], [2], [0], [5]]), t([1.0]), ids([0, 0, 0, 1, 1, 2]), estimator="rloo")
    close(out.advantages, [1, -0.5, -0.5, 2, -2, 0])


def test_rloo_group_scale():
    # rloo advantages divided by the group std of the rewards: group [1, 0]: loo [1, -1], std sqrt(0.5)
    out = compute_advantages(t([[1], [0]]), t([1.0]), ids([0, 0]), estimator="rloo", scale="group")
    s = math.sqrt(0.5) + EPS
    close(out.advantages, [1 / s, -1 / s])


def test_reinforce_plus_plus_batch_std_of_advantages():
    # groups [0,0 | 1,1], rewards [1,0 | 2,2]: centred [0.5, -0.5, 0, 0]
    # batch std of the *advantages*: mean 0, Σd² = 0.5, /3 → std sqrt(1/6)
    # (the std of the rewards would be sqrt(2.75/3): this checks which one is used)
    out = compute_advantages(t([[1], [0], [2], [2]]), t([1.0]), ids([0, 0, 1, 1]), estimator="reinforce_plus_plus")
    s = math.sqrt(1 / 6) + EPS
    close(out.advantages, [0.5 / s, -0.5 / s, 0, 0])


def test_reinforce_plus_plus_group_scale_equals_grpo_group():
    # std of (r - group mean) within a group equals the std of r: the same numbers as grpo/group
    rpf, w, g = t([[1], [0], [0], [3], [1]]), t([1.0]), ids([0, 0, 0, 1, 1])
    rpp = compute_advantages(rpf, w, g, estimator="reinforce_plus_plus", scale="group")
    grpo = compute_advantages(rpf, w, g, estimator="grpo", scale="group")
    torch.testing.assert_close(rpp.advantages, grpo.advantages)


def test_gdpo_per_function_then_batch():
    # weights [1, 0.5]
    # group 0: f1 [1, 0] → z = ±0.5/sqrt(0.5) = ±0.70711;  f2 [0, 1] → z = ∓0.70711
    #   weighted sum: ±(0.70711 - 0.35355) = ±a, a = 0.35355
    # group 1: f1 [1, 1] → std 0 → z = 0;  f2 [NaN, 1] → one value → z = 0, NaN → 0;  sum [0, 0]
    # batch: [a, -a, 0, 0], mean 0, std sqrt(2a²/3) → advantages ±sqrt(3/2), 0, 0
    rpf = t([[1, 0], [0, 1], [1, NAN], [1, 1]])
    out = compute_advantages(rpf, t([1.0, 0.5]), ids([0, 0, 1, 1]), scale="gdpo")
    close(out.advantages, [math.sqrt(1.5), -math.sqrt(1.5), 0, 0], atol=1e-6)


def test_gdpo_keeps_differences_grpo_collapses():
    # GDPO's motivation: reward vectors (1,0) and (0,1) sum to the same value, so GRPO sees no signal;
    # with unequal weights GDPO keeps it (the heavier function wins).
    rpf = t([[1, 0], [0, 1]])
    grpo = compute_advantages(rpf, t([1.0, 1.0]), ids([0, 0]))
    assert torch.equal(grpo.advantages, torch.zeros(2, dtype=torch.float64))
    out = compute_advantages(rpf, t([1.0, 0.5]), ids([0, 0]), scale="gdpo")
    assert out.advantages[0] > 0 > out.advantages[1]


def test_request_ids_count_a_trajectory_once():
    # group 0: trajectory 7 was split into two samples (rewards 0.2 then 1.0; the last one stands for it),
    # trajectory 8 has reward 0. Statistics over [1.0, 0]: mean 0.5, std sqrt(0.5).
    # Both samples of trajectory 7 get its advantage; counting it twice ([.2, 1, 0]) would give other numbers.
    out = compute_advantages(t([[0.2], [1.0], [0.0]]), t([1.0]), ids([0, 0, 0]), request_ids=ids([7, 7, 8]))
    s = math.sqrt(0.5) + EPS
    close(out.advantages, [0.5 / s, 0.5 / s, -0.5 / s])
    close(out.rewards, [0.2, 1.0, 0.0])  # per sample, not deduplicated
    assert out.metrics["reward/mean"] == pytest.approx(0.5)


def test_request_ids_must_stay_in_one_group():
    with pytest.raises(RolloutError, match="request id"):
        compute_advantages(t([[1.0], [0.0]]), t([1.0]), ids([0, 1]), request_ids=ids([3, 3]))


def test_reward_penalty_subtracted_first():
    # kl_in_reward: rewards [1, 1] minus β·KL [0.5, 0] = [0.5, 1]; group std sqrt(0.125), deviations ∓0.25
    out = compute_advantages(t([[1], [1]]), t([1.0]), ids([0, 0]), reward_penalty=t([0.5, 0.0]))
    close(out.rewards, [0.5, 1.0])
    s = math.sqrt(0.125) + EPS
    close(out.advantages, [-0.25 / s, 0.25 / s])


def test_unscored_sample_counts_as_zero_and_names_give_per_function_metrics():
    # sample 1 is scored by no function → nansum gives 0; per-function metrics skip NaN,
    # and a function that scored nothing reports NaN (not a fake 0)
    rpf = t([[1, NAN], [NAN, NAN], [0, NAN]])
    out = compute_advantages(rpf, t([1.0, 1.0]), ids([0, 0, 0]), reward_names=["acc", "fmt"])
    close(out.rewards, [1, 0, 0])
    assert out.metrics["rewards/acc/mean"] == pytest.approx(0.5)
    assert out.metrics["rewards/acc/std"] == pytest.approx(math.sqrt(0.5))
    assert math.isnan(out.metrics["rewards/fmt/mean"])
    assert torch.isfinite(out.advantages).all()


def test_default_scale_per_estimator():
    assert DEFAULT_SCALE == {"grpo": "group", "rloo": "none", "reinforce_plus_plus": "batch"}
    rpf, w, g = t([[1], [0], [0], [4]]), t([1.0]), ids([0, 0, 1, 1])
    for est, scale in DEFAULT_SCALE.items():
        torch.testing.assert_close(
            compute_advantages(rpf, w, g, estimator=est).advantages,
            compute_advantages(rpf, w, g, estimator=est, scale=scale).advantages,
        )


def test_validation_messages():
    with pytest.raises(ConfigError, match="--advantage_estimator 'ppo'"):
        validate_advantage_options("ppo", None, False)
    with pytest.raises(ConfigError, match="--scale_rewards 'std'"):
        validate_advantage_options("grpo", "std", False)
    with pytest.raises(ConfigError, match="kl_in_reward"):
        validate_advantage_options("grpo", "gdpo", True)
    with pytest.raises(ConfigError, match="gdpo"):
        validate_advantage_options("rloo", "gdpo", False)
    validate_advantage_options("reinforce_plus_plus", None, True)
    with pytest.raises(ConfigError, match="kl_in_reward"):
        compute_advantages(t([[1.0]]), t([1.0]), ids([0]), scale="gdpo", reward_penalty=t([0.1]))
    with pytest.raises(ConfigError, match="--reward_weights"):
        compute_advantages(t([[1.0, 2.0]]), t([1.0]), ids([0]))
    with pytest.raises(RewardError, match="group_ids"):
        compute_advantages(t([[1.0], [2.0]]), t([1.0]), ids([0]))


# ---------------------------------------------------------------- vectorised vs plain loop


def _std(values):
    vals = [v for v in values if not math.isnan(v)]
    return statistics.stdev(vals) if len(vals) > 1 else 0.0


def _mean(values):
    vals = [v for v in values if not math.isnan(v)]
    return statistics.fmean(vals) if vals else 0.0


def loop_advantages(rpf, w, gids, estimator, scale, rids=None, penalty=None, eps=EPS):
    """The ms-swift formulas written as a plain loop over groups, one sample at a time."""
    n, f = len(rpf), len(w)
    rewards = [sum(w[j] * rpf[i][j] for j in range(f) if not math.isnan(rpf[i][j])) for i in range(n)]
    if penalty is not None:
        rewards = [r - p for r, p in zip(rewards, penalty)]
    if rids is None:
        reps, rep_of = list(range(n)), list(range(n))
    else:
        last = {}
        for i, r in enumerate(rids):
            last[r] = i
        reps, rep_of = sorted(last.values()), [last[r] for r in rids]
    groups = defaultdict(list)
    for i in reps:
        groups[gids[i]].append(i)

    adv = {}
    if scale == "gdpo":
        summed = defaultdict(float)
        for j in range(f):
            for members in groups.values():
                col = [rpf[i][j] for i in members]
                m, s = _mean(col), _std(col)
                for i in members:
                    z = 0.0 if math.isnan(rpf[i][j]) else (rpf[i][j] - m) / (s + 1e-8)
                    summed[i] += w[j] * z
        m, s = _mean([summed[i] for i in reps]), _std([summed[i] for i in reps])
        adv = {i: (summed[i] - m) / (s + 1e-8) for i in reps}
    else:
        centred = {}
        for members in groups.values():
            k = len(members)
            m = statistics.fmean(rewards[i] for i in members)
            for i in members:
                c = rewards[i] - m
                if estimator == "rloo":
                    c = c * k / (k - 1) if k > 1 else 0.0
                centred[i] = c
        source = centred if estimator == "reinforce_plus_plus" else {i: rewards[i] for i in reps}
        for members in groups.values():
            s = _std([source[i] for i in members]) if scale == "group" else _std([source[i] for i in reps])
            for i in members:
                adv[i] = centred[i] if scale == "none" else centred[i] / (s + eps)
    return [adv[rep_of[i]] for i in range(n)]


COMBOS = [
    (e, s)
    for e, s in itertools.product(["grpo", "rloo", "reinforce_plus_plus"], ["group", "batch", "none", "gdpo"])
    if s != "gdpo" or e == "grpo"
]  # gdpo only with the grpo estimator


@pytest.mark.parametrize("seed", range(6))
def test_vectorised_matches_loop(seed):
    rng = random.Random(seed)
    sizes = [rng.randint(1, 6) for _ in range(rng.randint(1, 5))]
    gids = [1000 - 7 * g for g, k in enumerate(sizes) for _ in range(k)]  # sparse, descending ids
    order = list(range(len(gids)))
    rng.shuffle(order)  # groups interleaved, ids not dense
    gids = [gids[i] for i in order]
    n, f = len(gids), rng.randint(1, 3)
    levels = [0.0, 0.5, 1.0, 2.0]  # few levels so that equal-reward groups happen
    rpf = [
        [
            NAN if rng.random() < 0.2 else rng.choice(levels) + (rng.random() if rng.random() < 0.3 else 0)
            for _ in range(f)
        ]
        for _ in range(n)
    ]
    w = [rng.uniform(0.2, 2.0) for _ in range(f)]
    use_rids = seed % 2 == 1
    rids = None
    if use_rids:  # split some trajectories into two consecutive samples of the same group
        rids, next_id = [], 0
        for i in range(n):
            if i > 0 and gids[i] == gids[i - 1] and rng.random() < 0.4:
                rids.append(rids[-1])
            else:
                rids.append(next_id)
                next_id += 1
    penalty = [rng.uniform(0, 0.3) for _ in range(n)] if seed % 3 == 0 else None
    for estimator, scale in COMBOS:
        if scale == "gdpo" and penalty is not None:
            continue
        expected = loop_advantages(rpf, w, gids, estimator, scale, rids, penalty)
        out = compute_advantages(
            t(rpf),
            t(w),
            ids(gids),
            estimator=estimator,
            scale=scale,
            request_ids=None if rids is None else ids(rids),
            reward_penalty=None if penalty is None else t(penalty),
        )
        assert torch.isfinite(out.advantages).all()
        torch.testing.assert_close(
            out.advantages, t(expected), atol=1e-6, rtol=1e-6, msg=f"{estimator}/{scale} seed {seed}"
        )


@pytest.mark.parametrize("rids", [None, [0, 1, 2, 3, 3]])
def test_metrics_by_hand(rids):
    """One group, trajectory rewards 1, 0, 1, 0 (with rids, the last trajectory is two samples)."""
    n = 5 if rids else 4
    rewards = [[1.0], [0.0], [1.0], [0.0], [0.0]][:n]
    out = compute_advantages(
        t(rewards), t([1.0]), ids([0] * n), request_ids=None if rids is None else ids(rids), reward_names=["acc"]
    )
    std = math.sqrt(1 / 3)  # Bessel, over the four trajectories
    a = 0.5 / (std + EPS)
    close(out.advantages, [a, -a, a, -a, -a][:n])
    m = out.metrics
    assert m["reward/mean"] == pytest.approx(0.5) and m["rewards/acc/mean"] == pytest.approx(0.5)
    assert m["reward/std"] == pytest.approx(std) and m["reward/batch_std"] == pytest.approx(std)
    assert m["rewards/acc/std"] == pytest.approx(std) and m["frac_reward_zero_std"] == 0.0
    adv = [a, -a, a, -a, -a][:n]  # advantage statistics are over samples
    assert m["advantages/mean"] == pytest.approx(statistics.mean(adv), abs=1e-6)
    assert m["advantages/std"] == pytest.approx(statistics.stdev(adv))
    assert m["advantages/min"] == pytest.approx(-a) and m["advantages/max"] == pytest.approx(a)


@pytest.mark.parametrize("seed", range(4))
def test_usual_layout_matches_loop(seed):
    """G consecutive groups of K, no NaN, one sample per trajectory: the reshaped path of group_stats."""
    rng = random.Random(seed)
    k, g, f = rng.randint(2, 6), rng.randint(1, 4), rng.randint(1, 2)
    gids = [10 + 3 * j for j in range(g) for _ in range(k)]
    rpf = [
        [rng.choice([0.0, 0.5, 1.0]) + (rng.random() if rng.random() < 0.3 else 0) for _ in range(f)]
        for _ in range(g * k)
    ]
    w = [rng.uniform(0.2, 2.0) for _ in range(f)]
    for estimator, scale in COMBOS:
        expected = loop_advantages(rpf, w, gids, estimator, scale, None, None)
        for rids in (None, ids(list(range(g * k)))):
            out = compute_advantages(t(rpf), t(w), ids(gids), estimator=estimator, scale=scale, request_ids=rids)
            torch.testing.assert_close(
                out.advantages, t(expected), atol=1e-6, rtol=1e-6, msg=f"{estimator}/{scale} seed {seed}"
            )


def test_group_statistics_exact_for_equal_values_and_nan_aware():
    from grpokit.algorithms.advantages import Groups, group_stats

    x = torch.tensor([[0.1, 1.0], [0.1, 2.0], [0.1, 4.0], [0.3, 0.0], [0.7, 1.0], [0.2, 5.0]], dtype=torch.float64)
    groups = Groups.from_ids(ids([5, 5, 5, 2, 2, 2]))  # ids need not be dense or sorted
    stats = group_stats(x, groups)
    assert stats.std[1, 0].item() == 0.0 and stats.mean[1, 0].item() == 0.1  # equal values: exact
    torch.testing.assert_close(stats.mean[0], torch.tensor([0.4, 2.0], dtype=torch.float64))
    torch.testing.assert_close(stats.std[1], x[:3].std(dim=0))
    x[4, 1] = NAN  # an unscored sample leaves its group's count and statistics
    stats = group_stats(x, groups)
    torch.testing.assert_close(stats.n, torch.tensor([[3.0, 2.0], [3.0, 3.0]], dtype=torch.float64))
    torch.testing.assert_close(stats.mean[0, 1], torch.tensor(2.5, dtype=torch.float64))


def test_registries_hold_the_names():
    assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "rloo", "reinforce_plus_plus"}
    assert set(SCALE_MODES) == {"group", "batch", "none", "gdpo"}
