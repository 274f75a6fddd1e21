"""Weight-sync metadata: the bodies of /init_communicator/, /update_weights/ and /check_weights/, torch-free.

HTTP bodies of the rollout server. Unknown fields are refused (``extra="forbid"``), as in the protocol models.

Every field is bounded here, so that a body that validates cannot make the server allocate more than its limits
allow: weight-sync metadata is checked for consistency (shape × dtype = bytes, tensors inside their bucket, no
overlap, unique names) before anything is broadcast; the server then checks names and shapes against its model and
bucket sizes against ``--max_weight_bucket_mb`` (``check_bucket_sizes``).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_STRICT = ConfigDict(extra="forbid")

MAX_SYNC_TIMEOUT_S = 3600.0  # the largest timeout_s a body may ask for (the server caps it lower: --max_sync_timeout_s)
MAX_WORLD_SIZE = 1024
HOST_PATTERN = r"^[A-Za-z0-9._:\-]{1,253}$"  # a DNS name, IPv4 or IPv6 literal: no NUL, space, slash or brackets
GROUP_PATTERN = r"^[A-Za-z0-9._\-]{1,128}$"
WIRE_DTYPES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}  # dtype name on the wire → bytes per element
MAX_TENSOR_BYTES = 1 << 40  # no single tensor or bucket above 1 TiB, whatever the model (tighter checks follow)
MAX_TENSORS = 1 << 20
MAX_DIMS = 8


class InitCommunicatorBody(BaseModel):
    """``POST /init_communicator/``: join the trainer's weight-sync group (the trainer is rank 0, hosts the store)."""

    model_config = _STRICT

    host: str = Field(pattern=HOST_PATTERN, description="address of the trainer's TCPStore, as this server reaches it")
    port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1, le=MAX_WORLD_SIZE - 1, description="this server's rank; the trainer is 0")
    world_size: int = Field(ge=2, le=MAX_WORLD_SIZE, description="1 trainer + the number of servers")
    backend: Literal["gloo", "nccl"] = "gloo"
    group: str = Field(pattern=GROUP_PATTERN, description="key prefix in the store (one per session)")
    timeout_s: float = Field(
        120.0,
        ge=0.1,
        le=MAX_SYNC_TIMEOUT_S,
        description="rendezvous and per-broadcast timeout (capped by --max_sync_timeout_s)",
    )

    @model_validator(mode="after")
    def _rank_in_world(self) -> InitCommunicatorBody:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} must be below world_size {self.world_size}")
        return self


class TensorMeta(BaseModel):
    """One tensor inside a flat byte bucket."""

    model_config = _STRICT

    name: str = Field(min_length=1, max_length=1024)
    dtype: Literal[tuple(WIRE_DTYPES)] = Field(description="torch dtype name on the wire, e.g. 'float32'")
    shape: list[int] = Field(max_length=MAX_DIMS)
    offset: int = Field(ge=0, le=MAX_TENSOR_BYTES, description="byte offset in the bucket (aligned)")
    nbytes: int = Field(ge=0, le=MAX_TENSOR_BYTES)

    @field_validator("shape")
    @classmethod
    def _dims(cls, shape: list[int]) -> list[int]:
        if any(d < 0 or d > MAX_TENSOR_BYTES for d in shape):
            raise ValueError(f"shape {shape[:MAX_DIMS]}: every dimension must be in 0..{MAX_TENSOR_BYTES}")
        return shape

    @model_validator(mode="after")
    def _consistent(self) -> TensorMeta:
        size = WIRE_DTYPES[self.dtype]
        expected = math.prod(self.shape) * size
        if expected != self.nbytes:
            raise ValueError(
                f"{self.name}: shape {self.shape} of {self.dtype} is {expected} bytes, not nbytes {self.nbytes}"
            )
        if self.offset % size:
            raise ValueError(f"{self.name}: offset {self.offset} is not a multiple of {size} ({self.dtype})")
        return self


class WeightBucket(BaseModel):
    model_config = _STRICT

    nbytes: int = Field(ge=0, le=MAX_TENSOR_BYTES, description="size of the flat uint8 tensor that is broadcast")
    tensors: list[TensorMeta] = Field(min_length=1)

    @model_validator(mode="after")
    def _inside(self) -> WeightBucket:
        end = 0
        for m in sorted(self.tensors, key=lambda m: m.offset):
            if m.offset < end:
                raise ValueError(f"{m.name}: bytes {m.offset}..{m.offset + m.nbytes} overlap the tensor before it")
            end = m.offset + m.nbytes
        if end != self.nbytes:
            raise ValueError(f"bucket nbytes {self.nbytes} but its tensors end at byte {end}")
        return self


class AdapterBody(BaseModel):
    """An adapter-only update (engines/adapters.py): the LoRA factors in the buckets are served unmerged, as a new
    version, over the base named ``base_id`` (sent in the same update when ``base`` is true)."""

    model_config = _STRICT

    r: int = Field(ge=1, le=4096)
    lora_alpha: float = Field(gt=0, le=1e6)
    use_rslora: bool = False
    base_id: str = Field(pattern=GROUP_PATTERN)
    base: bool = Field(False, description="the update carries the base weights too")
    keep: int = Field(1, ge=1, le=64, description="versions kept loaded (--max_staleness + 1)")


class UpdateWeightsBody(BaseModel):
    """``POST /update_weights/``: metadata of every bucket; the bytes follow by broadcast, one bucket at a time."""

    model_config = _STRICT

    buckets: list[WeightBucket] = Field(max_length=MAX_TENSORS)
    dry_run: bool = Field(False, description="only check names, shapes and dtypes against the served model")
    version: int | None = Field(
        None,
        ge=0,
        le=2**62,
        description="the trainer's weight version (its optimizer "
        "step): the server tags what it samples from these weights with it",
    )
    interrupt: bool = Field(
        False,
        description="partial rollouts: generation running now pauses at its next token "
        "and continues on the new weights",
    )
    adapter: AdapterBody | None = Field(None, description="LoRA factors served unmerged (adapter-only sync)")

    @model_validator(mode="after")
    def _unique(self) -> UpdateWeightsBody:
        seen: set[str] = set()
        for b in self.buckets:
            for m in b.tensors:
                if m.name in seen:
                    raise ValueError(f"{m.name}: sent twice")
                seen.add(m.name)
        return self


def check_bucket_sizes(body: UpdateWeightsBody, max_bucket_bytes: int) -> list[str]:
    """Buckets above the cap. A bucket holding one tensor may be larger (the sender's rule: a tensor larger than
    the bucket size travels alone); its size is then bounded by the served parameter's shape, checked apart."""
    mb = max_bucket_bytes / 1024 / 1024
    return [
        f"bucket {i} of {b.nbytes} bytes with {len(b.tensors)} tensors exceeds --max_weight_bucket_mb {mb:g}; "
        "lower the trainer's --weight_sync_bucket_mb or raise the server's limit"
        for i, b in enumerate(body.buckets)
        if len(b.tensors) > 1 and b.nbytes > max_bucket_bytes
    ]


class TensorSums(BaseModel):
    """One tensor's checksums as the sender computed them over the bytes it sent (grpokit/wire/checksum.py)."""

    model_config = _STRICT

    name: str = Field(min_length=1, max_length=1024)
    dtype: Literal[tuple(WIRE_DTYPES)] = Field(description="the wire dtype the sums were taken in")
    sums: list[float | None] = Field(
        min_length=3, max_length=3, description="Σx, Σ|x|, Σw·x in float64; null where not finite"
    )


class CheckWeightsBody(BaseModel):
    """``POST /check_weights/``: after a sync, the checksums of every bucket it sent, bucket by bucket; the server
    computes the same over the weights its engine now holds and names the buckets and tensors that differ."""

    model_config = _STRICT

    buckets: list[list[TensorSums]] = Field(max_length=MAX_TENSORS)
    weight_version: int | None = Field(
        None,
        ge=0,
        description="the version the update answered: another sync since then is reported instead of a mismatch",
    )

    @model_validator(mode="after")
    def _unique(self) -> CheckWeightsBody:
        seen: set[str] = set()
        for b in self.buckets:
            for m in b:
                if m.name in seen:
                    raise ValueError(f"{m.name}: listed twice")
                seen.add(m.name)
        return self
