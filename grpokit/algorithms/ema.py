"""Reference-model mixing: ref ← α·π + (1 − α)·ref every ``--ref_model_sync_steps`` (``--sync_ref_model``).

From TR-DPO (arXiv 2404.09656) "soft update", as TRL's ``ref_model_mixup_alpha``. The GRPO paper (arXiv
2402.03300) instead resets the reference to the policy each iteration, which is α = 1 here. The update is done
in place, parameter by parameter, in the reference's dtype and on its device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from grpokit.errors import ConfigError


@torch.no_grad()
def ema_update_(ref_params: Iterable[Tensor], policy_params: Iterable[Tensor], alpha: float) -> None:
    """In place: each reference tensor ← α·policy + (1 − α)·reference."""
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"--ref_model_mixup_alpha {alpha}: must be in [0, 1] (1 copies the policy)")
    refs, pols = list(ref_params), list(policy_params)
    if len(refs) != len(pols):
        raise ConfigError(
            f"--sync_ref_model: the reference model has {len(refs)} parameters and the policy "
            f"{len(pols)}; the reference must have the policy's architecture"
        )
    for i, (ref, pol) in enumerate(zip(refs, pols, strict=True)):
        if ref.shape != pol.shape:
            raise ConfigError(
                f"--sync_ref_model: parameter {i} has shape {tuple(ref.shape)} in the reference and "
                f"{tuple(pol.shape)} in the policy; the reference must have the policy's architecture"
            )
        ref.lerp_(pol.to(device=ref.device, dtype=ref.dtype), alpha)  # ref + α(π − ref); exact at α = 0 and 1
