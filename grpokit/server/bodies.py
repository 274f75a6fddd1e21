"""HTTP bodies of the rollout server. Unknown fields are refused (``extra="forbid"``), as in the protocol models."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from grpokit.rollout.protocol import RequestConfig, RolloutInferRequest

_STRICT = ConfigDict(extra="forbid")


class InferBody(BaseModel):
    """``POST /infer/``: trajectories for ``requests``, sampled with ``request_config``."""

    model_config = _STRICT

    requests: list[RolloutInferRequest]
    request_config: RequestConfig = Field(default_factory=RequestConfig)


class InitCommunicatorBody(BaseModel):
    """``POST /init_communicator/``: join the trainer's weight-sync group (the trainer is rank 0, hosts the store)."""

    model_config = _STRICT

    host: str = Field(description="address of the trainer's TCPStore, as this server reaches it")
    port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1, description="this server's rank; the trainer is 0")
    world_size: int = Field(ge=2, description="1 trainer + the number of servers")
    backend: Literal["gloo", "nccl"] = "gloo"
    group: str = Field(min_length=1, max_length=128, description="key prefix in the store (one per session)")
    timeout_s: float = Field(120.0, gt=0, description="rendezvous and per-broadcast timeout")


class TensorMeta(BaseModel):
    """One tensor inside a flat byte bucket."""

    model_config = _STRICT

    name: str
    dtype: str = Field(description="torch dtype name on the wire, e.g. 'float32'")
    shape: list[int]
    offset: int = Field(ge=0, description="byte offset in the bucket (aligned)")
    nbytes: int = Field(ge=0)


class WeightBucket(BaseModel):
    model_config = _STRICT

    nbytes: int = Field(ge=0, description="size of the flat uint8 tensor that is broadcast")
    tensors: list[TensorMeta]


class UpdateWeightsBody(BaseModel):
    """``POST /update_weights/``: metadata of every bucket; the bytes follow by broadcast, one bucket at a time."""

    model_config = _STRICT

    buckets: list[WeightBucket]
    dry_run: bool = Field(False, description="only check names, shapes and dtypes against the served model")


def error_body(message: str, **extra: Any) -> dict[str, Any]:
    """The JSON every error answer carries: a one-line ``error`` plus optional details."""
    return {"error": message, **extra}
