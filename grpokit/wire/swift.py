"""ms-swift 4.x's rollout protocol (``swift rollout`` and its trainer's ``VLLMClient``) as bounded pydantic bodies,
torch-free: what ``grpokit rollout`` validates on ms-swift's routes (grpokit/server/swift_routes.py) and what
grpokit's trainer sends to a ``swift rollout`` server (grpokit/engines/swift_client.py).

Field names and meanings are ms-swift's (``RequestConfig``, ``RolloutInferRequest``, ``InitCommunicatorRequest``,
``UpdateWeightsRequest``, ``FlattenedTensorMetadata``). ms-swift sends ``null`` for a sampling field it leaves unset,
and these models read ``null`` as "unset" everywhere. Unknown fields are refused, as on grpokit's own routes.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from grpokit.protocol import (
    MAX_ID_CHARS,
    MAX_IMAGES,
    MAX_N,
    MAX_REGEX_CHARS,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOKENS,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    StopString,
    Text,
)
from grpokit.wire.bodies import HOST_PATTERN, MAX_DIMS, MAX_TENSOR_BYTES, MAX_TENSORS, WIRE_DTYPES

_STRICT = ConfigDict(extra="forbid")
MAX_TOP_LOGPROBS = 20


def swift_dtype(name: str) -> str:
    """ms-swift's dtype text (``str(torch.float32)`` = ``"torch.float32"``) as grpokit's wire name; ValueError
    naming the dtypes a weight may travel in."""
    short = name.removeprefix("torch.")
    if short not in WIRE_DTYPES:
        raise ValueError(f"dtype {name[:40]!r}: use one of {', '.join('torch.' + d for d in WIRE_DTYPES)}")
    return short


class SwiftRequestConfig(BaseModel):
    """ms-swift's ``RequestConfig``: every field, each nullable (null = unset, grpokit's default)."""

    model_config = _STRICT

    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    num_beams: int | None = Field(None, ge=1, le=MAX_N)
    stop: list[StopString] | None = Field(None, max_length=MAX_STOP_STRINGS)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    n: int | None = Field(None, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    length_penalty: float | None = Field(None, ge=-100.0, le=100.0)
    return_details: bool | None = None
    structured_outputs_regex: Text | None = Field(None, max_length=MAX_REGEX_CHARS)


class SwiftInferRequest(BaseModel):
    """ms-swift's ``RolloutInferRequest`` as its client posts it (``dataclasses.asdict``)."""

    model_config = _STRICT

    messages: list[dict[str, Any]] = Field(min_length=1)
    images: list[Annotated[Text, Field(min_length=1)]] | None = Field(None, max_length=MAX_IMAGES)
    audios: list[Any] | None = Field(None, max_length=MAX_IMAGES)
    videos: list[Any] | None = Field(None, max_length=MAX_IMAGES)
    tools: list[dict[str, Any]] | None = Field(None, max_length=1024)
    objects: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    data_dict: dict[str, Any] | None = None
    uuid: str | None = Field(None, min_length=1, max_length=MAX_ID_CHARS)
    add_eos: bool | Literal["auto"] | None = None  # 4.6: for scoring a finished response, not for sampling


class SwiftInferBody(BaseModel):
    """``POST /infer/`` in ms-swift's shape: ``infer_requests`` (the key that tells it from grpokit's ``requests``),
    one ``request_config`` for the call, and the client's other keyword arguments."""

    model_config = _STRICT

    infer_requests: list[SwiftInferRequest]
    request_config: SwiftRequestConfig | None = None
    metrics: Any = None
    use_tqdm: bool | None = None
    adapter_request: Any = None


class SwiftInitCommunicatorBody(BaseModel):
    """``POST /init_communicator/`` in ms-swift's shape: the server hosts the group's store at ``host:port`` and
    its ranks come first; the trainer joins as the last rank, ``world_size - 1``."""

    model_config = _STRICT

    host: str = Field(pattern=HOST_PATTERN)
    port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2, le=1024)


class SwiftNamedParamBody(BaseModel):
    """``POST /update_named_param/``: one tensor, broadcast next by the trainer."""

    model_config = _STRICT

    name: str = Field(min_length=1, max_length=1024)
    dtype: str = Field(max_length=40)
    shape: list[Annotated[int, Field(ge=0, le=MAX_TENSOR_BYTES)]] = Field(max_length=MAX_DIMS)

    @model_validator(mode="after")
    def _bounded(self) -> SwiftNamedParamBody:
        nbytes = math.prod(self.shape) * WIRE_DTYPES[swift_dtype(self.dtype)]
        if nbytes > MAX_TENSOR_BYTES:
            raise ValueError(f"{self.name}: shape {self.shape} is {nbytes} bytes, more than {MAX_TENSOR_BYTES}")
        return self


class SwiftFlatMeta(BaseModel):
    """ms-swift's ``FlattenedTensorMetadata``: a tensor at bytes ``start_idx:end_idx`` of a flat uint8 bucket
    (``numel`` counts those bytes)."""

    model_config = _STRICT

    name: str = Field(min_length=1, max_length=1024)
    shape: list[Annotated[int, Field(ge=0, le=MAX_TENSOR_BYTES)]] = Field(max_length=MAX_DIMS)
    dtype: str = Field(max_length=40)
    start_idx: int = Field(ge=0, le=MAX_TENSOR_BYTES)
    end_idx: int = Field(ge=0, le=MAX_TENSOR_BYTES)
    numel: int = Field(ge=0, le=MAX_TENSOR_BYTES)

    @model_validator(mode="after")
    def _consistent(self) -> SwiftFlatMeta:
        size = WIRE_DTYPES[swift_dtype(self.dtype)]
        expected = math.prod(self.shape) * size
        if self.end_idx - self.start_idx != self.numel or self.numel != expected:
            raise ValueError(
                f"{self.name}: shape {self.shape} of {self.dtype} is {expected} bytes, but start_idx {self.start_idx}"
                f", end_idx {self.end_idx} and numel {self.numel} say otherwise"
            )
        if self.start_idx % size:
            raise ValueError(f"{self.name}: start_idx {self.start_idx} is not a multiple of {size} ({self.dtype})")
        return self


class SwiftFlattenedBody(BaseModel):
    """``POST /update_flattened_params/``: one bucket's metadata, in byte order, then one broadcast of
    ``metadatas[-1].end_idx`` bytes."""

    model_config = _STRICT

    metadatas: list[SwiftFlatMeta] = Field(min_length=1, max_length=MAX_TENSORS)

    @model_validator(mode="after")
    def _tiled(self) -> SwiftFlattenedBody:
        end, seen = 0, set()
        for m in self.metadatas:
            if m.start_idx != end:
                raise ValueError(f"{m.name}: starts at byte {m.start_idx}; the tensor before it ends at {end}")
            if m.name in seen:
                raise ValueError(f"{m.name}: sent twice")
            end = m.end_idx
            seen.add(m.name)
        return self


class SwiftAdapterBody(BaseModel):
    """``POST /update_adapter_flattened_param/`` and ``/update_adapter_param/``: a LoRA adapter's config and
    tensors' metadata. Read only to answer that grpokit does not load adapters (the route's 501)."""

    model_config = ConfigDict(extra="allow")

    peft_config: dict[str, Any] = Field(default_factory=dict)
