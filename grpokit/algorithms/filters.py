"""Token and sample filters: overlong filtering and dynamic sampling (DAPO), high-entropy token masks.

- ``overlong_mask``/``loss_mask`` — DAPO (arXiv 2503.14476) "overlong filtering": truncated completions get no
  loss. The truncated rows leave the loss mask itself, so they leave every normaliser too, including the global
  token count of dapo/cispo/vespo: the trainer counts the tokens of ``loss_mask``, the mask the loss trains on
  (TRL counts its loss mask after ``mask_truncated_completions`` the same way; ms-swift's count keeps them).
- ``groups_with_signal`` — DAPO dynamic sampling keeps groups whose rewards are not all equal (reward std > 0);
  the trainer resamples the rest up to ``--max_resample_times``. The paper filters on accuracy being neither 0
  nor 1, which is the same test for 0/1 rewards. A group of one has std 0 and no signal.
- ``entropy_threshold``/``entropy_mask`` — "Beyond the 80/20 Rule" (arXiv 2506.01939): train only the
  top-``quantile`` fraction of tokens by entropy. The threshold is the (1 − quantile) quantile of the masked
  tokens' entropies with linear interpolation (torch.quantile's rule, as ms-swift's nanquantile), over the
  tensors it is given (the trainer gathers them across ranks); tokens with entropy ≥ threshold train.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpokit.algorithms.advantages import Groups, group_stats
from grpokit.errors import ConfigError


def overlong_mask(mask: Tensor, truncated: Tensor) -> Tensor:
    """[B, T], [B] bool -> [B, T]: the mask with truncated rows zeroed."""
    return mask * (~truncated.to(mask.device).bool()).unsqueeze(-1).to(mask.dtype)


def loss_mask(completion_mask: Tensor, truncated: Tensor, overlong_filter: bool) -> Tensor:
    """[B, T], [B] bool -> [B, T]: the tokens the loss trains on (truncated rows out under --overlong_filter).
    The loss and the token count of the global-token normaliser both read this one mask."""
    return overlong_mask(completion_mask, truncated) if overlong_filter else completion_mask


def validate_entropy_quantile(quantile: float) -> None:
    """--top_entropy_quantile must lie in (0, 1]."""
    if not 0.0 < quantile <= 1.0:
        raise ConfigError(
            f"--top_entropy_quantile {quantile}: must be in (0, 1]; 1 trains every token, 0.2 the top 20% by entropy"
        )


@torch.no_grad()
def entropy_threshold(entropies: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """Scalar threshold so that tokens with entropy >= it are the top-``quantile`` fraction of masked tokens."""
    validate_entropy_quantile(quantile)
    values = entropies[mask > 0]  # [n]
    n = values.numel()
    if n == 0:
        return torch.tensor(float("-inf"), dtype=entropies.dtype, device=entropies.device)
    work = values if values.dtype in (torch.float32, torch.float64) else values.float()
    pos = (1.0 - quantile) * (n - 1)  # linear interpolation between order statistics (torch.quantile)
    lo, hi = math.floor(pos), math.ceil(pos)
    v_lo = torch.kthvalue(work, lo + 1).values
    v_hi = torch.kthvalue(work, hi + 1).values if hi != lo else v_lo
    # in the entropies' dtype, so that quantile 1 (the minimum) compares equal to the smallest entropy
    return (v_lo + (v_hi - v_lo) * (pos - lo)).to(entropies.dtype)


def entropy_mask(entropies: Tensor, mask: Tensor, threshold: Tensor | float) -> Tensor:
    """[B, T] in ``mask``'s dtype: 1 where a masked-in token's entropy >= threshold."""
    return ((entropies >= threshold) & (mask > 0)).to(mask.dtype)


def groups_with_signal(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """[N] bool: the sample's group has reward std > 0 (DAPO dynamic sampling keeps these)."""
    groups = Groups.from_ids(group_ids.to(rewards.device))
    std = group_stats(rewards.float(), groups).std  # [G]
    return (std > 0)[groups.index]
