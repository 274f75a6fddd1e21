"""The interface every rollout backend implements (transformers, vLLM, a remote rollout server)."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import defaultdict

from grpokit.rollout.protocol import ChatCompletionResponse, RequestConfig, RolloutInferRequest


class InferEngine(ABC):
    """Turns requests into chat-completion responses. Subclasses implement ``infer``; ``infer_async`` batches the
    requests that are waiting at the same moment into one ``infer`` call, so that many concurrent multi-turn
    trajectories still make large batches."""

    engine_type: str = "base"

    def __init__(self) -> None:
        self._pending: list[tuple[RolloutInferRequest, RequestConfig, asyncio.Future]] = []
        self._flush_scheduled = False

    @abstractmethod
    def infer(self, requests: list[RolloutInferRequest], config: RequestConfig) -> list[ChatCompletionResponse]:
        """One response per request, each with ``config.n`` choices (or the request's own config)."""

    async def infer_async(self, request: RolloutInferRequest, config: RequestConfig) -> ChatCompletionResponse:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._pending.append((request, config, fut))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(lambda: loop.create_task(self._flush()))
        return await fut

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let every trajectory that is ready enqueue its request first
        pending, self._pending, self._flush_scheduled = self._pending, [], False
        by_config: dict[str, list] = defaultdict(list)
        for item in pending:
            cfg = item[0].request_config or item[1]
            by_config[cfg.model_dump_json()].append((item[0], cfg, item[2]))
        for items in by_config.values():
            try:
                out = await asyncio.to_thread(self.infer, [r for r, _, _ in items], items[0][1])
            except BaseException as e:  # noqa: BLE001 - handed to every waiting trajectory
                for _, _, fut in items:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, _, fut), resp in zip(items, out, strict=True):
                if not fut.done():
                    fut.set_result(resp)

    def sync_weights(self, model) -> None:
        """Make the engine sample from ``model``'s current weights. No-op where it shares them."""

    def reset_prefix_cache(self) -> None:
        """Drop cached prefixes computed with old weights."""

    def close(self) -> None:
        """Release resources."""
