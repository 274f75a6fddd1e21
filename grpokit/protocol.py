"""Data contracts between trainer, schedulers, engines and the rollout server.

Names follow ms-swift's ``infer_engine/protocol.py`` so that a scheduler or reward written for ms-swift ports
with little change. Everything here is a pydantic model: the same classes validate HTTP bodies in server mode
(unknown fields are refused there) and travel in process in colocate mode.
"""

from __future__ import annotations

import itertools
import json
import os
import uuid as _uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

FinishReason = Literal["stop", "length"]

_ID_PREFIX = _uuid.uuid4().hex[:16]  # random per import; with the pid, unique across processes and forks
_ID_COUNTER = itertools.count()


def new_id() -> str:
    """A unique id (32 hex digits), several times cheaper than ``uuid4().hex``: a rollout makes a few per
    trajectory."""
    return f"{_ID_PREFIX}{os.getpid() & 0xFFFFFF:06x}{next(_ID_COUNTER) & 0x3FFFFFFFFF:010x}"


# Bounds of every request (HTTP bodies in server mode, in-process calls in colocate mode). docs/server_mode.md
# lists them; the rollout server adds its own (context length, batch size, n = 1 per trajectory).
MAX_N = 1024
MAX_TOKENS = 1 << 20  # the model's context bounds it further (server: prompt + max_tokens <= max_model_len)
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0  # 0 is greedy; below 0.01 logits / T can overflow to inf (vLLM's floor)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_TOP_K = 1 << 20
MAX_SEED = 1 << 62  # room for seed + request index
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 128  # each stop set scans the vocabulary once
MAX_REGEX_CHARS = 8192
MAX_SCHEMA_CHARS = 65536
MAX_MESSAGES = 4096
MAX_ROLE_CHARS = 64
MAX_ID_CHARS = 256
MAX_JSON_DEPTH = 32  # nesting of free-form values (message fields, data_dict)
MAX_IMAGES = 256  # images per request on the wire (the server's --max_images_per_request bounds it further)


def check_utf8(value: Any, where: str, depth: int = 0) -> None:
    """ValueError naming ``where`` when a string inside ``value`` cannot be UTF-8 (a lone surrogate from a JSON
    ``\\ud800`` escape: no tokenizer and no JSON answer can carry it), or when ``value`` nests deeper than
    ``MAX_JSON_DEPTH`` (the answer that echoes it could not be serialised)."""
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"{where}: character {e.start} is a lone UTF-16 surrogate ({value[e.start]!a}); send valid Unicode text"
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_utf8(k, where, depth + 1)
            check_utf8(v, f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_utf8(v, f"{where}[{i}]", depth + 1)


Text = Annotated[str, AfterValidator(lambda s: (check_utf8(s, "text"), s)[1])]
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class RequestConfig(BaseModel):
    """Sampling settings for one engine call (vLLM ``SamplingParams`` / HF ``generate`` kwargs)."""

    model_config = ConfigDict(extra="forbid")

    n: int = Field(1, ge=1, le=MAX_N, description="completions per request")
    max_tokens: int = Field(256, ge=1, le=MAX_TOKENS, description="new tokens per completion (per turn)")
    temperature: float = Field(
        1.0, ge=0.0, le=MAX_TEMPERATURE, description=f"0 means greedy; otherwise at least {MIN_TEMPERATURE}"
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=MAX_TOP_K, description="-1 or 0 disables top-k")
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    stop: list[StopString] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS, description="stop strings (not included in the output)"
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    logprobs: bool = Field(False, description="return the sampled tokens' (processed) logprobs")
    structured_outputs_regex: Text | None = Field(
        None, max_length=MAX_REGEX_CHARS, description="completion must match this regex"
    )
    structured_outputs_json: dict[str, Any] | Text | None = Field(
        None,
        description="completion must be JSON valid against this schema: a JSON object, or its JSON text "
        "(a file path is read only from grpokit train's --structured_outputs_json)",
    )
    weight_version: int | None = Field(
        None,
        ge=0,
        le=2**62,
        description="the LoRA weight version to sample (a rollout server serving adapter-only syncs keeps several); "
        "None: the newest",
    )

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, t: float) -> float:
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature {t:g} must be 0 (greedy) or at least {MIN_TEMPERATURE} (smaller values "
                "overflow the scaled logits)"
            )
        return t

    @field_validator("structured_outputs_json")
    @classmethod
    def _check_schema(cls, schema: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
        if schema is None:
            return None
        text = schema if isinstance(schema, str) else json.dumps(schema)
        if len(text) > MAX_SCHEMA_CHARS:
            raise ValueError(f"structured_outputs_json has {len(text)} characters, more than {MAX_SCHEMA_CHARS}")
        if isinstance(schema, str) and not schema.lstrip().startswith("{"):
            raise ValueError(
                "structured_outputs_json must be a JSON schema given as a JSON object or as JSON text "
                "starting with '{' (file paths are read only from grpokit train's "
                "--structured_outputs_json)"
            )
        check_utf8(schema, "structured_outputs_json")
        return schema


def _content_text(content: Any, where: str) -> str:
    """A message's content as one string: text, or a list of OpenAI text parts joined with newlines (what vLLM
    does for a chat template that takes string content). ValueError for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                got = f"type {kind!r}" if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"{where}[{k}]: only text parts {{'type': 'text', 'text': str}} are supported "
                    f"(this server serves a text-only chat template), got {got}"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"{where} must be a string or a list of text parts, got {_type_name(content)}")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def check_message(m: Any, i: int) -> dict[str, Any]:
    """One chat message, checked and normalised: ``role`` a non-empty string, ``content`` a string (text parts
    joined; null only beside ``tool_calls``, read as ""). Other keys (tool_calls, name, ...) pass through."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ValueError(f"{where} must be an object with 'role' and 'content', got {_type_name(m)}")
    if "role" not in m or "content" not in m:
        raise ValueError(f"{where} needs 'role' and 'content', got keys {sorted(map(str, m))}")
    role = m["role"]
    if not isinstance(role, str) or not 0 < len(role) <= MAX_ROLE_CHARS:
        shown = f"{len(role)} characters" if isinstance(role, str) else _type_name(role)
        raise ValueError(f"{where}.role must be a string of 1 to {MAX_ROLE_CHARS} characters, got {shown}")
    content = m["content"]
    if content is None and m.get("tool_calls"):
        content = ""
    check_utf8(m, where)
    content = _content_text(content, f"{where}.content")
    return m if content is m["content"] else {**m, "content": content}


_MESSAGES_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "maxItems": MAX_MESSAGES,
    "items": {
        "type": "object",
        "required": ["role", "content"],
        "additionalProperties": True,
        "properties": {
            "role": {"type": "string", "minLength": 1, "maxLength": MAX_ROLE_CHARS},
            "content": {
                "anyOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["type", "text"],
                            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                        },
                    },
                ]
            },
        },
    },
}


class RolloutInferRequest(BaseModel):
    """One trajectory's current request: the conversation so far plus the dataset row's other columns."""

    model_config = ConfigDict(extra="forbid")

    messages: Annotated[list[dict[str, Any]], WithJsonSchema(_MESSAGES_SCHEMA)]
    data_dict: dict[str, Any] = Field(default_factory=dict)
    request_id: str = Field(default_factory=new_id, min_length=1, max_length=MAX_ID_CHARS)
    prompt_id: str = Field(default_factory=new_id, min_length=1, max_length=MAX_ID_CHARS)
    # Optional per-request sampling override set by a scheduler for one turn (e.g. a structured-output regex).
    request_config: RequestConfig | None = None
    # The wire form of the prompt's images (ms-swift's RolloutInferRequest.images): each a base64 string
    # ("data:image/png;base64,..." or raw) or a path under the server's --media_root. The rollout server decodes
    # them into data_dict["images"], where every scheduler and engine reads a row's images in process.
    images: list[Annotated[Text, Field(min_length=1)]] = Field(default_factory=list, max_length=MAX_IMAGES)

    @property
    def uuid(self) -> str:  # ms-swift name
        return self.request_id

    @field_validator("messages")
    @classmethod
    def _check_messages(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not messages:
            raise ValueError("messages must hold at least one message")
        if len(messages) > MAX_MESSAGES:
            raise ValueError(f"{len(messages)} messages, more than {MAX_MESSAGES}")
        checked = [check_message(m, i) for i, m in enumerate(messages)]
        if all(a is b for a, b in zip(checked, messages)):
            return messages  # unchanged: keep the caller's list (schedulers edit it in place)
        return checked

    @field_validator("data_dict", "request_id", "prompt_id")
    @classmethod
    def _check_text(cls, value: Any, info) -> Any:
        check_utf8(value, info.field_name)
        return value


class ChatMessage(dict):
    """A reply message: the dict ``{"role": "assistant", "content": text}`` (so it serialises, compares and goes
    into message lists as before) that also reads as ms-swift's plugins read it: ``choice.message.content``.
    ``tool_calls`` and ``reasoning_content`` read as None when absent, as in ms-swift's ``ChatMessage``."""

    _OPTIONAL = frozenset({"tool_calls", "reasoning_content"})

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            if name in ChatMessage._OPTIONAL:
                return None
            raise AttributeError(f"message has no {name!r} (keys: {', '.join(map(str, self)) or 'none'})") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self[name]
        except KeyError:
            raise AttributeError(name) from None


class ChatCompletionResponseChoice(BaseModel):
    index: int = 0
    # {"role": "assistant", "content": text}: a dict, read by attribute too (``message.content``)
    message: Annotated[dict[str, Any], AfterValidator(ChatMessage)]
    finish_reason: FinishReason
    token_ids: list[int]
    # {"content": [{"token_id": int, "logprob": float}, ...]} when logprobs were asked for, else None
    logprobs: dict[str, Any] | None = None
    # per token, the trainer's weight version (its optimizer step at the sync) that sampled it: a rollout server
    # tags its answers (two versions in one choice: a partial rollout resumed on new weights); None elsewhere
    weight_versions: list[int] | None = None


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
    ``weight_versions[k]`` has, per token of segment k, the weight version (the trainer's optimizer step at its
    weight sync) that sampled it: the server's tag where it gave one, else the version the rollout began with (the
    oldest it can be); a trajectory without tokens keeps one entry, ``[[version it began with]]``; empty: not
    recorded.
    """

    response: ChatCompletionResponse
    messages: list[dict[str, Any]]
    response_token_ids: list[list[int]] = Field(default_factory=list)
    response_loss_mask: list[list[int]] = Field(default_factory=list)
    rollout_infos: dict[str, Any] = Field(default_factory=dict)
    rollout_logprobs: list[list[float]] = Field(default_factory=list)
    weight_versions: list[list[int]] = Field(default_factory=list)
    request_id: str = ""
    prompt_id: str = ""
    # The prompt as the trajectory started (after on_trajectory_start edits, e.g. an env's first observation);
    # the trainer encodes this as the prompt, in colocate and server mode alike.
    prompt_messages: list[dict[str, Any]] | None = None

    def oldest_weight_version(self) -> int | None:
        """The oldest weight version among ``weight_versions`` (None: not recorded)."""
        return min((v for segment in self.weight_versions for v in segment), default=None)


def choice_logprobs(choice: ChatCompletionResponseChoice) -> list[float]:
    """The per-token logprobs of a choice, or [] when the engine returned none."""
    if not choice.logprobs:
        return []
    return [float(item["logprob"]) for item in choice.logprobs.get("content", [])]
