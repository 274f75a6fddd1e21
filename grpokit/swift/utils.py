"""``swift.utils``: ``get_logger`` and ``to_device``, the helpers ms-swift's plugins import."""

from __future__ import annotations

import logging
from typing import Any


def get_logger(name: str = "grpokit.plugin") -> logging.Logger:
    """A logger under grpokit's, so plugin messages show with the run's own."""
    return logging.getLogger(name)


def to_device(data: Any, device: Any) -> Any:
    """``data`` with every tensor moved to ``device``, through dicts, lists and tuples."""
    if hasattr(data, "to") and callable(data.to):
        return data.to(device)
    if isinstance(data, dict):
        return {k: to_device(v, device) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(to_device(v, device) for v in data)
    return data


__all__ = ["get_logger", "to_device"]
