"""Group-relative advantages from per-function rewards.

Estimators (``--advantage_estimator``) choose the baseline; scale modes (``--scale_rewards``) choose the divisor.

- ``grpo`` — GRPO, arXiv 2402.03300: A = (r − mean_group) / std_group. Differences from the paper: the std is
  Bessel-corrected and ``eps`` = 1e-4 is added to it (ms-swift), and the divisor is selectable: ``batch`` uses the
  std over the whole batch, ``none`` drops it (Dr. GRPO, arXiv 2503.20783, which argues the group std biases
  towards too-easy and too-hard prompts).
- ``rloo`` — RLOO, arXiv 2402.14740: the baseline of sample i is the mean of the *other* K−1 samples of its group,
  r_i − (Σr − r_i)/(K−1) = (r_i − mean)·K/(K−1). A group of one has no other sample and gets advantage 0.
  Unscaled by default, like the paper.
- ``reinforce_plus_plus`` — REINFORCE++-baseline, arXiv 2501.03262: group-mean baseline, then the advantages are
  divided by their own batch std. The paper also subtracts the batch mean of the advantages; that mean is 0
  already because every group's centred rewards sum to 0, so the step is omitted (as in ms-swift).
- ``gdpo`` scale mode — GDPO, arXiv 2601.05242: each reward function is normalised within its group first
  ((r_f − mean)/(std + 1e-8), NaN → 0), the weighted sum is then normalised over the batch ((s − mean)/(std +
  1e-8)). The 1e-8 follows ms-swift, not ``eps``. Only with the ``grpo`` estimator and without a reward penalty.

Beyond the papers (from ms-swift): rewards are a weighted ``nansum`` over the functions (NaN = "this function did
not score this sample"; a sample that no function scored gets 0), an optional per-sample penalty (β·KL with
``--kl_in_reward``) is subtracted before anything else, group sizes may differ, and samples sharing a request id
(one multi-turn trajectory split into several training samples, ms-swift "Case 2") are counted once in every
statistic — the last of them stands for the trajectory and all of them get its advantage.

A group of size 1 or with all-equal rewards gets advantage exactly 0, and nothing here produces NaN.

The per-group statistics they use (``group_stats``, ``Groups``) run over a flat batch, without a Python loop over
groups. Samples of one prompt share a group id; groups may have different sizes. Statistics ignore NaN entries (a reward
function that did not score a sample) and are shifted by the group's first value before summing, so a group whose
values are all equal gets exactly its value as mean and exactly 0 as std (no rounding residue that a later
division by ``std + eps`` would blow up).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from grpokit.errors import ConfigError, RewardError, RolloutError
from grpokit.registry import Registry

GDPO_EPS = 1e-8  # ms-swift's epsilon for both GDPO normalisations


# -- per-group statistics ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Groups:
    """Dense group index of each sample and the size of each group."""

    index: Tensor  # [M] long in [0, G)
    count: Tensor  # [G] long, samples per group

    @classmethod
    def from_ids(cls, group_ids: Tensor) -> Groups:
        """Build from arbitrary (not necessarily dense or sorted) group ids."""
        _, index, count = torch.unique(group_ids, return_inverse=True, return_counts=True)
        return cls(index=index, count=count)

    @classmethod
    def single(cls, size: int, device: torch.device) -> Groups:
        """The whole batch as one group (for batch-level statistics)."""
        index = torch.zeros(size, dtype=torch.long, device=device)
        return cls(index=index, count=torch.tensor([size], device=device))

    @property
    def num_groups(self) -> int:
        return self.count.numel()


@dataclass(frozen=True)
class GroupStats:
    mean: Tensor  # [G] or [G, C]; 0 where a group has no non-NaN value
    std: Tensor  # same shape; Bessel-corrected (like torch.std), 0 where fewer than two values
    n: Tensor  # same shape; number of non-NaN values


def group_stats(x: Tensor, groups: Groups) -> GroupStats:
    """NaN-aware mean and Bessel-corrected std of ``x`` ([M] or [M, C]) within each group."""
    flat = x.reshape(x.shape[0], -1)  # [M, C]
    m, c = flat.shape
    g = groups.num_groups
    valid = ~torch.isnan(flat)  # [M, C]
    idx = groups.index.unsqueeze(1).expand(m, c)  # [M, C]

    # shift each group by its first non-NaN value so equal values cancel exactly
    pos = torch.arange(m, device=x.device).unsqueeze(1).expand(m, c)
    pos = torch.where(valid, pos, m)
    first = torch.full((g, c), m, dtype=torch.long, device=x.device)
    first = first.scatter_reduce(0, idx, pos, reduce="amin", include_self=True)  # [G, C]
    has_value = first < m
    shift = torch.where(has_value, flat.gather(0, first.clamp(max=max(m - 1, 0))), 0.0)  # [G, C]

    zeros = torch.zeros(g, c, dtype=flat.dtype, device=x.device)
    n = zeros.index_add(0, groups.index, valid.to(flat.dtype))  # [G, C]
    d = torch.where(valid, flat - shift[groups.index], 0.0)
    mean = shift + zeros.index_add(0, groups.index, d) / n.clamp(min=1)
    dev = torch.where(valid, flat - mean[groups.index], 0.0)
    var = zeros.index_add(0, groups.index, dev * dev) / (n - 1).clamp(min=1)
    std = torch.where(n > 1, var.sqrt(), 0.0)

    shape = (g,) + tuple(x.shape[1:])
    return GroupStats(mean=mean.reshape(shape), std=std.reshape(shape), n=n.reshape(shape))


def batch_stats(x: Tensor) -> GroupStats:
    """group_stats with the whole batch as one group: [1] or [1, C]."""
    return group_stats(x, Groups.single(x.shape[0], x.device))


@dataclass
class AdvantageOut:
    advantages: Tensor  # [N]
    rewards: Tensor  # [N] weighted sum of the reward functions, minus the penalty
    metrics: dict[str, float]


@dataclass(frozen=True)
class AdvantageContext:
    """What an estimator or a scale mode may look at; one row per trajectory (after request-id dedup)."""

    rewards: Tensor  # [M] weighted reward (penalty already subtracted)
    rewards_per_func: Tensor  # [M, F] raw rewards, NaN = not scored
    weights: Tensor  # [F]
    groups: Groups
    reward_stats: GroupStats  # of ``rewards`` per group, [G]
    eps: float


@dataclass(frozen=True)
class Centered:
    """An estimator's output: reward minus baseline, and the values whose spread scales it."""

    advantages: Tensor  # [M]
    std_source: Tensor  # [M] rewards (grpo, rloo) or the advantages themselves (reinforce_plus_plus)


Estimator = Callable[[AdvantageContext], Centered]
ScaleMode = Callable[[Centered, AdvantageContext], Tensor]

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator", "--advantage_estimator")
SCALE_MODES: Registry = Registry("reward scaling mode", "--scale_rewards")
DEFAULT_SCALE = {"grpo": "group", "rloo": "none", "reinforce_plus_plus": "batch"}


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_baseline(ctx: AdvantageContext) -> Centered:
    """A = r − group mean."""
    adv = ctx.rewards - ctx.reward_stats.mean[ctx.groups.index]
    return Centered(advantages=adv, std_source=ctx.rewards)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_baseline(ctx: AdvantageContext) -> Centered:
    """A = (r − group mean)·K/(K−1), the leave-one-out baseline; 0 for a group of one."""
    k = ctx.groups.count[ctx.groups.index].to(ctx.rewards.dtype)  # [M]
    factor = torch.where(k > 1, k / (k - 1).clamp(min=1), 0.0)
    adv = (ctx.rewards - ctx.reward_stats.mean[ctx.groups.index]) * factor
    return Centered(advantages=adv, std_source=ctx.rewards)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus_baseline(ctx: AdvantageContext) -> Centered:
    """A = r − group mean, later scaled by the spread of A itself."""
    adv = ctx.rewards - ctx.reward_stats.mean[ctx.groups.index]
    return Centered(advantages=adv, std_source=adv)


@SCALE_MODES.register("group")
def scale_by_group_std(c: Centered, ctx: AdvantageContext) -> Tensor:
    stats = ctx.reward_stats if c.std_source is ctx.rewards else group_stats(c.std_source, ctx.groups)
    std = stats.std[ctx.groups.index]  # [M]
    return c.advantages / (std + ctx.eps)


@SCALE_MODES.register("batch")
def scale_by_batch_std(c: Centered, ctx: AdvantageContext) -> Tensor:
    std = batch_stats(c.std_source).std  # [1]
    return c.advantages / (std + ctx.eps)


@SCALE_MODES.register("none")
def no_scaling(c: Centered, ctx: AdvantageContext) -> Tensor:
    return c.advantages


@SCALE_MODES.register("gdpo")
def gdpo_scaling(c: Centered, ctx: AdvantageContext) -> Tensor:
    """Normalise each function within its group, sum with the weights, normalise over the batch."""
    rpf = ctx.rewards_per_func  # [M, F]
    st = group_stats(rpf, ctx.groups)  # [G, F]
    z = (rpf - st.mean[ctx.groups.index]) / (st.std[ctx.groups.index] + GDPO_EPS)
    summed = (torch.nan_to_num(z, nan=0.0) * ctx.weights).sum(dim=1)  # [M]
    bs = batch_stats(summed)
    return (summed - bs.mean) / (bs.std + GDPO_EPS)


def validate_advantage_options(estimator: str, scale: str | None, kl_in_reward: bool) -> None:
    """Raise ConfigError for an unknown estimator/scale or a combination that would silently drop something."""
    ADVANTAGE_ESTIMATORS.get_or_raise(estimator)
    scale = DEFAULT_SCALE.get(estimator, "group") if scale is None else scale
    SCALE_MODES.get_or_raise(scale)
    if scale == "gdpo" and kl_in_reward:
        raise ConfigError(
            "--scale_rewards gdpo normalises each reward function on its own, so the β·KL penalty of "
            "--kl_in_reward true would be dropped; use --kl_in_reward false (KL in the loss) or another --scale_rewards"
        )
    if scale == "gdpo" and estimator != "grpo":
        raise ConfigError(
            f"--scale_rewards gdpo replaces the baseline of --advantage_estimator {estimator!r}; "
            "use --advantage_estimator grpo with gdpo, or another --scale_rewards"
        )


def compute_advantages(
    rewards_per_func: Tensor,
    weights: Tensor,
    group_ids: Tensor,
    *,
    estimator: str = "grpo",
    scale: str | None = None,
    request_ids: Tensor | None = None,
    reward_penalty: Tensor | None = None,
    eps: float = 1e-4,
    reward_names: Sequence[str] | None = None,
) -> AdvantageOut:
    """Advantages [N] from rewards [N, F] (NaN = not scored), weights [F] and group ids [N].

    ``request_ids`` [N]: samples with the same id are one trajectory, counted once in group statistics.
    ``reward_penalty`` [N]: subtracted from the weighted reward first (``--kl_in_reward``).
    ``reward_names`` (optional, F names): adds ``rewards/<name>/mean`` and ``/std`` to the metrics.
    """
    scale = DEFAULT_SCALE.get(estimator, "group") if scale is None else scale
    estimate: Estimator | None = ADVANTAGE_ESTIMATORS.get(estimator)
    rescale: ScaleMode | None = SCALE_MODES.get(scale)
    if estimate is None or rescale is None or scale == "gdpo":  # else the options have nothing to refuse
        validate_advantage_options(estimator, scale, kl_in_reward=reward_penalty is not None)

    rpf, weights = _check_inputs(rewards_per_func, weights, group_ids, request_ids, reward_penalty, reward_names)
    group_ids = group_ids.to(rpf.device)
    request_ids = None if request_ids is None else request_ids.to(rpf.device)
    rewards = (rpf * weights).nansum(dim=1)  # [N]
    if reward_penalty is not None:
        rewards = rewards - reward_penalty.to(rewards)

    rep, sample_to_rep = _trajectory_index(group_ids, request_ids)  # [M], [N]; None: one sample per trajectory
    groups = Groups.from_ids(group_ids if rep is None else group_ids[rep])
    traj_rewards = rewards if rep is None else rewards[rep]  # [M]
    ctx = AdvantageContext(
        rewards=traj_rewards,
        rewards_per_func=rpf if rep is None else rpf[rep],
        weights=weights,
        groups=groups,
        reward_stats=group_stats(traj_rewards, groups),
        eps=eps,
    )
    advantages = rescale(estimate(ctx), ctx)
    if sample_to_rep is not None:
        advantages = advantages[sample_to_rep]  # [N]
    metrics = _metrics(ctx, advantages, reward_names)
    return AdvantageOut(advantages=advantages, rewards=rewards, metrics=metrics)


def _check_inputs(
    rpf: Tensor,
    weights: Tensor,
    group_ids: Tensor,
    request_ids: Tensor | None,
    reward_penalty: Tensor | None,
    reward_names: Sequence[str] | None,
) -> tuple[Tensor, Tensor]:
    if rpf.ndim != 2 or rpf.shape[0] == 0:
        raise RewardError(f"rewards_per_func must be [N, F] with N > 0 samples, got shape {tuple(rpf.shape)}")
    n, f = rpf.shape
    if weights.shape != (f,):
        raise ConfigError(
            f"--reward_weights: {weights.numel()} weights for {f} reward functions; give one per function"
        )
    for name, t in (("group_ids", group_ids), ("request_ids", request_ids), ("reward_penalty", reward_penalty)):
        if t is not None and t.shape != (n,):
            raise RewardError(f"{name} must have shape [{n}] (one per sample), got {tuple(t.shape)}")
    if reward_names is not None and len(reward_names) != f:
        raise RewardError(f"reward_names has {len(reward_names)} names for {f} reward functions")
    dtype = rpf.dtype if rpf.is_floating_point() else torch.float32
    return rpf.to(dtype), weights.to(device=rpf.device, dtype=dtype)


def _trajectory_index(group_ids: Tensor, request_ids: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """Representative sample of each trajectory (its last one, in batch order) and each sample's trajectory;
    (None, None) when every sample is its own trajectory."""
    if request_ids is None:
        return None, None
    n = group_ids.shape[0]
    uniq, inverse = torch.unique(request_ids, return_inverse=True)
    if uniq.numel() == n:
        return None, None
    arange = torch.arange(n, device=group_ids.device)
    last = torch.full((uniq.numel(),), -1, dtype=torch.long, device=group_ids.device)
    last = last.scatter_reduce(0, inverse, arange, reduce="amax", include_self=True)  # [U]
    rep, order = last.sort()
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    sample_to_rep = position[inverse]  # [N]
    if not torch.equal(group_ids, group_ids[rep][sample_to_rep]):
        raise RolloutError(
            "samples that share a request id have different group ids; one trajectory must belong "
            "to one prompt group (check the scheduler's prompt_id/request_id)"
        )
    return rep, sample_to_rep


def _metrics(ctx: AdvantageContext, advantages: Tensor, reward_names: Sequence[str] | None) -> dict[str, float]:
    group_std = ctx.reward_stats.std  # [G]
    f = ctx.rewards_per_func.shape[1]
    # the summed reward, each function's and (one row per trajectory) the advantages: [M, 1 + F (+ 1)], one pass
    joint = advantages.shape[0] == ctx.rewards.shape[0]
    columns = [ctx.rewards[:, None], ctx.rewards_per_func] + ([advantages[:, None]] if joint else [])
    stats = batch_stats(torch.cat(columns, dim=1))
    adv = stats if joint else batch_stats(advantages[:, None])
    parts = [
        stats.mean[0, : 1 + f],
        stats.std[0, : 1 + f],
        stats.n[0, 1 : 1 + f],
        torch.stack(
            [
                adv.mean[0, -1],
                adv.std[0, -1],
                advantages.min(),
                advantages.max(),
                group_std.mean(),
                (group_std <= 1e-8).to(group_std.dtype).mean(),
            ]
        ),
    ]  # isclose(std, 0); std >= 0
    values = iter(torch.cat(parts).tolist())  # one conversion for all of them
    means, stds, scored, scalars = ([next(values) for _ in range(p.numel())] for p in parts)
    out = {"reward/mean": means[0], "reward/batch_std": stds[0]}
    keys = (
        "advantages/mean",
        "advantages/std",
        "advantages/min",
        "advantages/max",
        "reward/std",
        "frac_reward_zero_std",
    )
    out.update(zip(keys, scalars, strict=True))
    if reward_names is not None:
        for i, name in enumerate(reward_names):  # a function that scored nothing reports NaN, not 0
            out[f"rewards/{name}/mean"] = means[1 + i] if scored[i] else float("nan")
            out[f"rewards/{name}/std"] = stds[1 + i] if scored[i] else float("nan")
    return out
