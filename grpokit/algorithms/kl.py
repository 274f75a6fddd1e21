"""KL estimators between the policy and the reference model.

- ``k3_kl`` is the per-token estimator GRPO (arXiv 2402.03300, eq. 4) puts in the loss:
  KL ≈ π_ref/π_θ − log(π_ref/π_θ) − 1, unbiased and non-negative. Difference from the paper: ms-swift's two
  clamps (the log ratio to [−20, 20] before ``exp``, the result to [−10, 10]) so that one bad token cannot
  overflow the loss; inside those ranges the value is exact.
- ``kl_reward_penalty`` is the k1 estimator summed over a sequence, β·Σ_t (log π_old − log π_ref), which
  ``--kl_in_reward`` subtracts from the reward before advantages (as in PPO-style RLHF and REINFORCE++,
  arXiv 2501.03262) instead of adding β·KL to the loss. It uses the rollout-time policy (``old_logps``) and
  carries no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor


def k3_kl(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Per-token k3 KL [B, T]: exp(d) − d − 1 with d = ref − logps, both clamped as in ms-swift."""
    d = torch.clamp(ref_logps - logps, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(d) - d - 1.0, min=-10.0, max=10.0)


def kl_reward_penalty(old_logps: Tensor, ref_logps: Tensor, mask: Tensor, beta: float) -> Tensor:
    """Per-sequence penalty [B]: β·Σ_t (old − ref) over the masked tokens (detached)."""
    maskb = mask > 0
    diff = torch.where(maskb, old_logps.detach() - ref_logps.detach(), 0.0)  # [B, T]; padding may hold -inf
    return beta * diff.sum(dim=-1)
