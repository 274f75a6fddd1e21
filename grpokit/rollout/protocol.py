"""The rollout data contracts, re-exported where plugins written against earlier grpokit versions look for them.
They live in ``grpokit.protocol``, the bottom layer, so that every layer may import them."""

from grpokit.protocol import (  # noqa: F401
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    RequestConfig,
    RolloutInferRequest,
    RolloutOutput,
    choice_logprobs,
    new_id,
)
