"""Server mode's scheduler on the trainer side: every trajectory (single- or multi-turn) runs on the rollout
servers, which hold their own schedulers; the trainer still only asks a scheduler for trajectories."""

from __future__ import annotations

from collections.abc import Sequence

from grpokit.engines.client import RolloutClient
from grpokit.protocol import RequestConfig, RolloutInferRequest, RolloutOutput
from grpokit.rollout.scheduler import RolloutScheduler


class RemoteScheduler(RolloutScheduler):
    """The trainer's scheduler in server mode: every trajectory (single- or multi-turn) runs on the servers."""

    def __init__(self, client: RolloutClient, **kwargs) -> None:
        super().__init__(infer_engine=client, **kwargs)

    @property
    def uses_env_reward(self) -> bool:  # the server's scheduler decides (e.g. gym_scheduler)
        return bool(self.infer_engine.engine_info().get("uses_env_reward", False))

    async def run(self, infer_request: RolloutInferRequest, request_config: RequestConfig,
                  **kwargs) -> list[RolloutOutput]:
        return await self.infer_engine.infer_trajectories_async([infer_request], request_config)

    async def async_infer(self, requests: Sequence[RolloutInferRequest],
                          request_config: RequestConfig) -> list[RolloutOutput]:
        return await self.infer_engine.infer_trajectories_async(requests, request_config)
