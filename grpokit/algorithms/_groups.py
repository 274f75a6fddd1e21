"""Per-group statistics over a flat batch, without a Python loop over groups.

Samples of one prompt share a group id; groups may have different sizes. Statistics ignore NaN entries (a reward
function that did not score a sample) and are shifted by the group's first value before summing, so a group whose
values are all equal gets exactly its value as mean and exactly 0 as std (no rounding residue that a later
division by ``std + eps`` would blow up).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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
