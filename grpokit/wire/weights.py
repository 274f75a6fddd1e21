"""The byte layout of a weight-sync bucket: dtype names on the wire, bucket planning, packing and unpacking."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from grpokit.wire.bodies import TensorMeta, WeightBucket

ALIGN = 16  # bytes; covers every dtype's element size


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """A torch dtype from its wire name; ValueError for anything else."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(specs: Iterable[tuple[str, Sequence[int], torch.dtype]], bucket_bytes: int) -> list[WeightBucket]:
    """Group (name, shape, dtype) specs, in order, into buckets of at most ``bucket_bytes`` (aligned offsets).

    A tensor larger than ``bucket_bytes`` gets a bucket of its own.
    """
    buckets: list[WeightBucket] = []
    metas: list[TensorMeta] = []
    used = 0
    for name, shape, dtype in specs:
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        offset = _aligned(used)
        if metas and offset + nbytes > bucket_bytes:
            buckets.append(WeightBucket(nbytes=used, tensors=metas))
            metas, offset = [], 0
        metas.append(TensorMeta(name=name, dtype=dtype_name(dtype), shape=list(shape), offset=offset, nbytes=nbytes))
        used = offset + nbytes
    if metas:
        buckets.append(WeightBucket(nbytes=used, tensors=metas))
    return buckets


def pack(buf_B: torch.Tensor, meta: TensorMeta, tensor: torch.Tensor) -> None:
    """Write ``tensor`` (cast to the wire dtype) into the uint8 bucket ``buf_B`` at ``meta.offset``."""
    wire = tensor.to(device=buf_B.device, dtype=parse_dtype(meta.dtype)).contiguous().reshape(-1)
    buf_B[meta.offset : meta.offset + meta.nbytes].copy_(wire.view(torch.uint8))


def unpack(buf_B: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """A view of one tensor inside the uint8 bucket ``buf_B`` (no copy)."""
    raw = buf_B[meta.offset : meta.offset + meta.nbytes]
    return raw.view(parse_dtype(meta.dtype)).view(meta.shape)
