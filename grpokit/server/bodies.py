"""HTTP bodies of the rollout server. Unknown fields are refused (``extra="forbid"``), as in the protocol models;
the weight-sync bodies are in ``grpokit.wire.weights``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from grpokit.protocol import RequestConfig, RolloutInferRequest

_STRICT = ConfigDict(extra="forbid")


class InferBody(BaseModel):
    """``POST /infer/``: trajectories for ``requests``, sampled with ``request_config``."""

    model_config = _STRICT

    requests: list[RolloutInferRequest]
    request_config: RequestConfig = Field(default_factory=RequestConfig)


class ProbeBody(BaseModel):
    """``POST /probe/``: a few greedy tokens with their logprobs for one short user prompt (the weight-sync
    check's probe, grpokit/engines/sync_check/probe.py)."""

    model_config = _STRICT

    prompt: str = Field(max_length=2000)
    max_tokens: int = Field(4, ge=1, le=16)
