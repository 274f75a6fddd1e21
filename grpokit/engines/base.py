"""The interface every rollout backend implements (transformers, vLLM, a remote rollout server)."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from grpokit.protocol import ChatCompletionResponse, RequestConfig, RolloutInferRequest


class InferEngine(ABC):
    """Turns requests into chat-completion responses. Subclasses implement ``infer``; ``infer_async`` batches the
    requests that are waiting at the same moment into one ``infer`` call, so that many concurrent multi-turn
    trajectories still make large batches.

    Where ``infer_async`` runs ``infer``:
    - by default on one long-lived thread of the engine's own, so the event loop stays free (the rollout server
      answers other requests meanwhile). That thread takes the creating thread's torch thread count (torch keeps
      it per thread: a plain worker thread would use every core whatever the user set), and engines that are not
      thread-safe (vLLM's ``LLM``) never see two callers at once;
    - with ``infer_on_loop_thread=True`` (a constructor argument), on the event loop's own thread. The trainer
      and ``grpokit infer`` build the engines they own so: nothing else needs that loop while the batch
      generates (trajectories waiting on an environment queue their next turn for the following batch either
      way), and sampling on the thread that also trains measured ~20% faster per step on the tiny benchmark model
      here (bench/bench_step.py)."""

    engine_type: str = "base"
    policy_version: int | None = None  # the trainer's optimizer step whose weights the next sync carries

    def set_policy_version(self, version: int) -> None:
        """Called by the trainer before each weight sync: an engine that tags its samples (a rollout server's
        client sends it with the weights) reads it; others ignore it."""
        self.policy_version = version

    weights_incomplete: bool = False  # a rollout server's update failed halfway: no version describes its weights

    def mark_weights_incomplete(self, incomplete: bool) -> None:
        """A rollout server's record of its last weight update: failed halfway (True: its generation routes answer
        503 until a whole one loads, server/calls.py) or loaded whole (False)."""
        self.weights_incomplete = incomplete

    def __init__(self, infer_on_loop_thread: bool = False) -> None:
        self._pending: list[tuple[RolloutInferRequest, RequestConfig, asyncio.Future]] = []
        self._flush_scheduled = False
        self._worker: ThreadPoolExecutor | None = None
        self.infer_on_loop_thread = infer_on_loop_thread

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
        loop = asyncio.get_running_loop()
        pending, self._pending, self._flush_scheduled = self._pending, [], False
        by_config: dict[str, list] = defaultdict(list)
        for item in pending:
            cfg = item[0].request_config or item[1]
            by_config[cfg.model_dump_json()].append((item[0], cfg, item[2]))
        for items in by_config.values():
            try:
                batch = [r for r, _, _ in items]
                if self.infer_on_loop_thread:
                    out = self.infer(batch, items[0][1])
                else:
                    out = await loop.run_in_executor(self._infer_thread(), self.infer, batch, items[0][1])
            except BaseException as e:  # noqa: BLE001 - handed to every waiting trajectory
                for _, _, fut in items:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, _, fut), resp in zip(items, out, strict=True):
                if not fut.done():
                    fut.set_result(resp)

    def _infer_thread(self) -> ThreadPoolExecutor:
        if self._worker is None:
            import torch

            # torch's intra-op thread count is per thread: carry over the caller's (e.g. --threads in a benchmark)
            self._worker = ThreadPoolExecutor(
                1,
                thread_name_prefix=f"grpokit-{self.engine_type}-infer",
                initializer=torch.set_num_threads,
                initargs=(torch.get_num_threads(),),
            )
        return self._worker

    def sync_weights(self, model) -> None:
        """Make the engine sample from ``model``'s current weights. No-op where it shares them."""

    def reset_prefix_cache(self) -> None:
        """Drop cached prefixes computed with old weights."""

    def close(self) -> None:
        """Release resources. Subclasses call ``super().close()``: it stops the infer thread."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.shutdown(wait=True)
