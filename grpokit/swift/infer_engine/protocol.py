"""``swift.infer_engine.protocol``: grpokit's protocol types under ms-swift's names."""

from grpokit.protocol import (  # noqa: F401 (re-exported)
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    RequestConfig,
    RolloutInferRequest,
    RolloutOutput,
)

__all__ = [
    "ChatCompletionResponse",
    "ChatCompletionResponseChoice",
    "ChatMessage",
    "RequestConfig",
    "RolloutInferRequest",
    "RolloutOutput",
]
