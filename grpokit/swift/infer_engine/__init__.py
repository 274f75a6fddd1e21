"""``swift.infer_engine``: ``RequestConfig``, the protocol types and ``TransformersEngine`` as ms-swift's plugins
call it (``TransformersEngine(model, template=template, max_batch_size=0)``, ``engine.infer(requests,
request_config, use_tqdm=False)`` with requests given as dicts or ``RolloutInferRequest``)."""

from __future__ import annotations

from typing import Any

from grpokit.engines.transformers_engine import TransformersEngine as _Engine
from grpokit.errors import ConfigError
from grpokit.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    RequestConfig,
    RolloutInferRequest,
    RolloutOutput,
)
from grpokit.template.encode import ChatTemplate

_NO_LIMIT = 1 << 30


def as_request(request: Any) -> RolloutInferRequest:
    """A ``RolloutInferRequest`` from one (ms-swift passes dicts: ``messages`` plus other columns)."""
    if isinstance(request, RolloutInferRequest):
        return request
    if not isinstance(request, dict) or "messages" not in request:
        raise ValueError(
            f"infer: a request must be a RolloutInferRequest or a dict with 'messages', got {type(request).__name__}"
        )
    return RolloutInferRequest(
        messages=list(request["messages"]), data_dict={k: v for k, v in request.items() if k != "messages"}
    )


class TransformersEngine(_Engine):
    """grpokit's transformers engine with ms-swift's constructor and ``infer`` call. ``max_batch_size=0`` means
    no limit, as in ms-swift. ``use_tqdm`` is accepted for ms-swift's signature; grpokit shows no bar here."""

    def __init__(self, model: Any, template: ChatTemplate | None = None, max_batch_size: int = 0, **kwargs: Any):
        if isinstance(model, str) or template is None:
            raise ConfigError(
                "grpokit.swift TransformersEngine: pass a loaded model and its template "
                "(TransformersEngine(model, template=template)); loading by name is not supported here"
            )
        if kwargs:
            raise ConfigError(
                f"grpokit.swift TransformersEngine: options {', '.join(sorted(kwargs))} are not "
                "supported; only model, template and max_batch_size are"
            )
        super().__init__(model, template, max_batch_size=max_batch_size or _NO_LIMIT)

    def infer(
        self, requests: list[Any], request_config: RequestConfig | None = None, *, use_tqdm: bool = False
    ) -> list[ChatCompletionResponse]:
        return super().infer([as_request(r) for r in requests], request_config or RequestConfig())


__all__ = [
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatMessage",
    "RequestConfig",
    "RolloutInferRequest",
    "RolloutOutput",
    "TransformersEngine",
]
