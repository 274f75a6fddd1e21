"""A reward's return value as N scores: a list, tuple, 1-D array or 1-D tensor of exactly N finite numbers or
None (NaN), within float32's range; anything else is a one-line ``RewardError`` naming the reward (a ``[2, N/2]``
tensor is refused, never flattened)."""

from __future__ import annotations

import math
import numbers
import sys
from typing import TYPE_CHECKING, Any

from grpokit.errors import RewardError

if TYPE_CHECKING:
    import torch

_PREVIEW = 60
_FLOAT32_MAX = 3.4028234663852886e38
_BAD = object()


def preview(text: Any) -> str:
    s = repr(text)
    return s if len(s) <= _PREVIEW else s[: _PREVIEW - 3] + "..."


def check_scores(name: str, out: Any, completions: list[str]) -> torch.Tensor:
    """``out`` of the reward ``name`` as a float32 tensor [N] (NaN = not scored); RewardError otherwise."""
    import torch

    n = len(completions)
    if not isinstance(out, (list, tuple)) and hasattr(out, "tolist") and hasattr(out, "shape"):
        shape = tuple(out.shape)
        if len(shape) != 1:  # a [2, N/2] tensor is not N scores, whatever its size
            raise RewardError(
                f"reward {name!r} returned a {type(out).__name__} of shape {list(shape)}; need a list or a 1-D "
                f"array/tensor of {n} scores (one per completion)"
            )
        out = out.detach().float().cpu().tolist() if isinstance(out, torch.Tensor) else out.tolist()
    if not isinstance(out, (list, tuple)):
        raise RewardError(
            f"reward {name!r} returned {type(out).__name__}, not a list of {n} scores (one per completion)"
        )
    if len(out) != n:
        first = min(len(out), n)
        where = f"first sample without a score: {first} {preview(completions[first])}" if n > first else ""
        raise RewardError(
            f"reward {name!r} returned {len(out)} scores for {n} completions; {where or 'too many scores'}"
        )
    values = []
    for j, v in enumerate(out):
        f = _as_score(v)
        if f is _BAD or abs(f) > _FLOAT32_MAX:  # 1e39 is a float, and inf in float32 (the scores' dtype)
            beyond = " (beyond float32's range, ±3.4e38, the training dtype of scores)" if f is not _BAD else ""
            raise RewardError(
                f"reward {name!r}: sample {j} got score {preview(v)}{beyond} (need a finite number or None); "
                f"completion {preview(completions[j])}"
            )
        values.append(f)
    return torch.tensor(values, dtype=torch.float32)


def _as_score(v: Any) -> Any:
    """float(v), NaN for None/NaN, or _BAD for anything else (strings, inf, containers)."""
    if v is None:
        return math.nan
    torch = sys.modules.get("torch")  # a tensor can only come from an imported torch
    if torch is not None and isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    elif hasattr(v, "item") and getattr(v, "shape", None) == ():
        v = v.item()  # numpy scalar
    if not isinstance(v, numbers.Real):  # bool is an int, so True/False pass as 1.0/0.0
        return _BAD
    f = float(v)
    return _BAD if math.isinf(f) else f
