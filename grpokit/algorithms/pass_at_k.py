"""pass@k, mean@K and their confidence intervals over a set of prompts: sampled evaluation.

pass@k is the chance that at least one of k completions of a prompt passes. From n samples of which c pass, the
unbiased estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", arXiv:2107.03374) is
1 − C(n−c, k) / C(n, k). Here it is the product form of the same ratio, 1 − ∏_{i=n−c+1}^{n} (1 − k/i), in float64:
no binomial is formed, so nothing overflows at large n (C(2000, 1000) is far beyond a float). The benchmark figure
is the mean of the per-prompt estimates. mean@K is the mean reward over all K samples of every prompt (the raw
reward, not thresholded: for a 0/1 reward it equals pass@1).

Confidence intervals (the paper gives none): the normal approximation of a mean over prompts, mean ± z·s/√P, with
s the sample standard deviation (ddof 1) of the P per-prompt values and z = 1.96 (95 %); pass@k's interval is
clipped to [0, 1]. The prompts are the random draw here (the usual benchmark view); each prompt's sampling noise is
part of its value's spread. With fewer than two prompts there is no interval (None).

Which k: the powers of two below K, and K itself (``ks_up_to``): pass@1, pass@2, pass@4 at K = 4; at K = 64 seven
values rather than 64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Z_95 = 1.959963984540054  # the standard normal's 97.5 % quantile: a two-sided 95 % interval


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``n`` samples, ``c`` of them passing (0 ≤ c ≤ n, 1 ≤ k ≤ n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a passing sample
        return 1.0
    miss = 1.0  # C(n−c, k) / C(n, k) = ∏_{i=n−c+1}^{n} (1 − k/i)
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def ks_up_to(num_samples: int) -> list[int]:
    """The k reported for K samples: 1, 2, 4, … below K, then K."""
    if num_samples < 1:
        raise ValueError(f"pass@k needs at least one sample per prompt; got {num_samples}")
    ks, k = [], 1
    while k < num_samples:
        ks.append(k)
        k *= 2
    return [*ks, num_samples]


@dataclass(frozen=True)
class Estimate:
    """A mean over prompts and its normal-approximation interval (None with fewer than two prompts)."""

    value: float
    ci_low: float | None
    ci_high: float | None
    prompts: int


def mean_interval(values_P: Sequence[float], z: float = Z_95, clip: tuple[float, float] | None = None) -> Estimate:
    """The mean of ``values_P`` (one per prompt) with mean ± z·s/√P, s the sample standard deviation."""
    n = len(values_P)
    if n == 0:
        raise ValueError("an estimate over prompts needs at least one prompt")
    mean = math.fsum(values_P) / n
    if n < 2:
        return Estimate(mean, None, None, n)
    s = math.sqrt(math.fsum((v - mean) ** 2 for v in values_P) / (n - 1))
    low, high = mean - z * s / math.sqrt(n), mean + z * s / math.sqrt(n)
    if clip is not None:
        low, high = max(clip[0], low), min(clip[1], high)
    return Estimate(mean, low, high, n)


def sampled_metrics(scores_PK: Sequence[Sequence[float]], threshold: float, z: float = Z_95) -> dict[str, float]:
    """One reward's sampled-evaluation figures from its scores, one row of K samples per prompt.

    A sample passes when its score ≥ ``threshold``. A NaN score (the reward does not judge that sample) is left
    out: a prompt counts for pass@k when at least k of its samples were judged, and for mean@K when one was. Keys:
    ``pass@k`` for each k of ``ks_up_to(K)``, ``mean@K``, and ``<key>_ci_low`` / ``<key>_ci_high`` for each when
    two or more prompts count; a figure no prompt counts for is left out.
    """
    num_samples = max((len(row) for row in scores_PK), default=0)
    if num_samples == 0:
        return {}
    judged = [[s for s in row if not math.isnan(s)] for row in scores_PK]
    out: dict[str, float] = {}

    def put(key: str, est: Estimate) -> None:
        out[key] = est.value
        if est.ci_low is not None:
            out[f"{key}_ci_low"], out[f"{key}_ci_high"] = est.ci_low, est.ci_high

    for k in ks_up_to(num_samples):
        per_prompt = [pass_at_k(len(row), sum(s >= threshold for s in row), k) for row in judged if len(row) >= k]
        if per_prompt:
            put(f"pass@{k}", mean_interval(per_prompt, z, clip=(0.0, 1.0)))
    means = [math.fsum(row) / len(row) for row in judged if row]
    if means:
        put(f"mean@{num_samples}", mean_interval(means, z))
    return out
