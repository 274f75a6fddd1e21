"""Data contracts between trainer, schedulers, engines and the rollout server.

Names follow ms-swift's ``infer_engine/protocol.py`` so that a scheduler or reward written for ms-swift ports
with little change. Everything here is a pydantic model: the same classes validate HTTP bodies in server mode
(unknown fields are refused there) and travel in process in colocate mode.
"""

from __future__ import annotations

import itertools
import os
import uuid as _uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

FinishReason = Literal["stop", "length"]

_ID_PREFIX = _uuid.uuid4().hex[:16]  # random per import; with the pid, unique across processes and forks
_ID_COUNTER = itertools.count()


def new_id() -> str:
    """A unique id (32 hex digits), several times cheaper than ``uuid4().hex``: a rollout makes a few per
    trajectory."""
    return f"{_ID_PREFIX}{os.getpid() & 0xFFFFFF:06x}{next(_ID_COUNTER) & 0x3FFFFFFFFF:010x}"


class RequestConfig(BaseModel):
    """Sampling settings for one engine call (vLLM ``SamplingParams`` / HF ``generate`` kwargs)."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(1, ge=1, description="completions per request")
    max_tokens: int = Field(256, ge=1, description="new tokens per completion (per turn)")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1 or 0 disables top-k")
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop: list[str] = Field(default_factory=list, description="stop strings (not included in the output)")
    seed: int | None = None
    logprobs: bool = Field(False, description="return the sampled tokens' (processed) logprobs")
    structured_outputs_regex: str | None = Field(None, description="completion must match this regex")
    structured_outputs_json: dict[str, Any] | str | None = Field(
        None, description="completion must be JSON valid against this schema (dict or JSON text)"
    )


class RolloutInferRequest(BaseModel):
    """One trajectory's current request: the conversation so far plus the dataset row's other columns."""

    model_config = ConfigDict(extra="forbid")

    messages: list[dict[str, Any]]
    data_dict: dict[str, Any] = Field(default_factory=dict)
    request_id: str = Field(default_factory=new_id)
    prompt_id: str = Field(default_factory=new_id)
    # Optional per-request sampling override set by a scheduler for one turn (e.g. a structured-output regex).
    request_config: RequestConfig | None = None

    @property
    def uuid(self) -> str:  # ms-swift name
        return self.request_id

    @field_validator("messages")
    @classmethod
    def _check_messages(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not messages:
            raise ValueError("messages must hold at least one message")
        for i, m in enumerate(messages):
            if "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] needs 'role' and 'content', got keys {sorted(m)}")
        return messages


class ChatCompletionResponseChoice(BaseModel):
    index: int = 0
    message: dict[str, Any]  # {"role": "assistant", "content": text}
    finish_reason: FinishReason
    token_ids: list[int]
    # {"content": [{"token_id": int, "logprob": float}, ...]} when logprobs were asked for, else None
    logprobs: dict[str, Any] | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=new_id)
    model: str = ""
    choices: list[ChatCompletionResponseChoice]
    prompt_token_ids: list[int] | None = None


class RolloutOutput(BaseModel):
    """One finished trajectory.

    ``response_token_ids[k]`` are the token ids of the k-th assistant message after the prompt (a continued
    message is one segment); ``response_loss_mask[k]`` has the same length (0 = not trained on).
    ``rollout_logprobs[k]`` holds one logprob per token of segment k whose mask is 1.
    """

    response: ChatCompletionResponse
    messages: list[dict[str, Any]]
    response_token_ids: list[list[int]] = Field(default_factory=list)
    response_loss_mask: list[list[int]] = Field(default_factory=list)
    rollout_infos: dict[str, Any] = Field(default_factory=dict)
    rollout_logprobs: list[list[float]] = Field(default_factory=list)
    request_id: str = ""
    prompt_id: str = ""
    # The prompt as the trajectory started (after on_trajectory_start edits, e.g. an env's first observation);
    # the trainer encodes this as the prompt, in colocate and server mode alike.
    prompt_messages: list[dict[str, Any]] | None = None


def choice_logprobs(choice: ChatCompletionResponseChoice) -> list[float]:
    """The per-token logprobs of a choice, or [] when the engine returned none."""
    if not choice.logprobs:
        return []
    return [float(item["logprob"]) for item in choice.logprobs.get("content", [])]
