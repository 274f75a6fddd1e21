"""Flat Python lists to CPU tensors, fast.

``torch.tensor(list)`` inspects every element (about 0.13 ms per thousand ints on the CI machine); filling a typed
``array`` first and wrapping its buffer is about three times faster. The rollout path builds a few such tensors
every step (prompt ids, the training batch), where it added up to a few tenths of a millisecond.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import torch


def long_tensor(values: Iterable[int]) -> torch.Tensor:
    """A 1-D int64 tensor of ``values`` (ints or bools)."""
    return _wrap(array("q", values), torch.long)


def float_tensor(values: Iterable[float]) -> torch.Tensor:
    """A 1-D float32 tensor of ``values`` (NaN allowed)."""
    return _wrap(array("f", values), torch.float32)


def _wrap(buf: array, dtype: torch.dtype) -> torch.Tensor:
    if not buf:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype)  # shares the array's memory and keeps it alive
