"""pass@k, mean@K and their intervals (algorithms/pass_at_k.py) against numbers worked out by hand."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from grpokit.algorithms.pass_at_k import Z_95, ks_up_to, mean_interval, pass_at_k, sampled_metrics

# (n, c, k) → 1 − C(n−c, k)/C(n, k), worked out by hand
TABLE = [
    (4, 0, 1, 0.0),
    (4, 0, 4, 0.0),
    (4, 1, 1, 0.25),  # one passing sample of four
    (4, 1, 2, 0.5),  # 1 − C(3,2)/C(4,2) = 1 − 3/6
    (4, 1, 4, 1.0),  # n − c = 3 < k = 4: every 4-subset holds the passing one
    (4, 2, 2, 5 / 6),  # 1 − C(2,2)/C(4,2) = 1 − 1/6
    (4, 3, 2, 1.0),  # n − c = 1 < 2
    (4, 4, 1, 1.0),
    (5, 2, 3, 0.9),  # 1 − C(3,3)/C(5,3) = 1 − 1/10
    (10, 3, 2, 24 / 45),  # 1 − C(7,2)/C(10,2) = 1 − 21/45
    (10, 1, 1, 0.1),  # pass@1 is c/n
]


@pytest.mark.parametrize(("n", "c", "k", "expected"), TABLE)
def test_pass_at_k_table(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_exact_binomials_and_stays_finite_at_large_n():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 300)
        c, k = rng.randint(0, n), rng.randint(1, n)
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12)
    # C(2000, 1000) ≈ 2e600 is no float; the product form needs none: 1 − C(1999, 1000)/C(2000, 1000) = 1 − 1000/2000
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5, abs=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_ks_are_powers_of_two_then_k():
    assert ks_up_to(1) == [1]
    assert ks_up_to(4) == [1, 2, 4]
    assert ks_up_to(6) == [1, 2, 4, 6]
    assert ks_up_to(64) == [1, 2, 4, 8, 16, 32, 64]


def test_dataset_figures_and_intervals_by_hand():
    # four prompts, K = 4, a 0/1 reward, c = 0, 1, 2, 4 passing
    scores = [[0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 1], [1, 1, 1, 1]]
    m = sampled_metrics(scores, threshold=1.0)
    assert set(m) == {
        f"{key}{end}" for key in ("pass@1", "pass@2", "pass@4", "mean@4") for end in ("", "_ci_low", "_ci_high")
    }
    # pass@1 per prompt 0, .25, .5, 1 → mean .4375; deviations −.4375 −.1875 .0625 .5625, squares sum .546875,
    # s = sqrt(.546875 / 3) = .426956, s/√4 = .213478, × 1.96 = .418417 → [.019083, .855917]
    assert m["pass@1"] == pytest.approx(0.4375)
    assert m["pass@1_ci_low"] == pytest.approx(0.4375 - Z_95 * math.sqrt(0.546875 / 3) / 2)
    assert m["pass@1_ci_low"] == pytest.approx(0.019083, abs=1e-5)
    assert m["pass@1_ci_high"] == pytest.approx(0.855917, abs=1e-5)
    # pass@2 per prompt 0, .5, 5/6, 1 → 2.3333/4; pass@4: 0, 1, 1, 1 → .75
    assert m["pass@2"] == pytest.approx((0.5 + 5 / 6 + 1) / 4)
    assert m["pass@4"] == pytest.approx(0.75)
    # pass@4: values 0, 1, 1, 1; s = .5, the upper end .75 + 1.96·.25 = 1.24 is clipped to 1
    assert m["pass@4_ci_high"] == 1.0 and m["pass@4_ci_low"] == pytest.approx(0.75 - Z_95 * 0.25)
    assert m["mean@4"] == pytest.approx(7 / 16)  # a 0/1 reward: mean@K = pass@1


def test_threshold_decides_a_pass_and_mean_uses_the_raw_scores():
    scores = [[0.5, 1.0], [0.5, 0.5]]
    m = sampled_metrics(scores, threshold=1.0)
    assert m["pass@1"] == pytest.approx((0.5 + 0.0) / 2)  # prompt 1: one pass of two; prompt 2: none
    assert m["pass@2"] == pytest.approx(0.5)
    assert m["mean@2"] == pytest.approx((0.75 + 0.5) / 2)  # not thresholded
    assert sampled_metrics(scores, threshold=0.5)["pass@1"] == 1.0


def test_unjudged_samples_are_left_out():
    nan = float("nan")
    # prompt 2 has one judged sample: it counts for pass@1 and mean@2, not for pass@2; prompt 3 for nothing
    m = sampled_metrics([[1.0, 0.0], [1.0, nan], [nan, nan]], threshold=1.0)
    assert m["pass@1"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["pass@2"] == 1.0 and "pass@2_ci_low" not in m  # one prompt: no interval
    assert m["mean@2"] == pytest.approx(0.75)
    assert sampled_metrics([[nan, nan]], threshold=1.0) == {}


def test_one_prompt_has_no_interval():
    est = mean_interval([0.3])
    assert (est.value, est.ci_low, est.ci_high, est.prompts) == (0.3, None, None, 1)
    with pytest.raises(ValueError, match="at least one prompt"):
        mean_interval([])
