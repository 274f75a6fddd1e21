"""Schedulers turn requests into trajectories; the trainer and the rollout server only ever talk to one.

``RolloutScheduler`` is single-turn: its ``run()`` makes one engine call. Multi-turn schedulers
(``grpokit.rollout.multi_turn``) subclass it. ``run_trajectories`` drives any scheduler over a batch of requests
concurrently, so the engine sees every trajectory's current turn in one batch — the same code in colocate mode
and inside the rollout server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from grpokit.aio import run_sync
from grpokit.data.images import row_images
from grpokit.protocol import ChatCompletionResponse, RequestConfig, RolloutInferRequest, RolloutOutput, choice_logprobs
from grpokit.rollout.turn_images import take_entry_images, take_start_images

logger = logging.getLogger(__name__)


class RolloutScheduler:
    """Single-turn scheduler: one engine call per request, all tokens trained."""

    uses_env_reward = False  # True: rollout_infos['total_reward'] becomes the extra reward column 'gym_reward'

    def __init__(
        self,
        infer_engine=None,
        max_turns: int | None = None,
        uses_env_reward: bool | None = None,
        text_only: bool = False,
        **kwargs,
    ) -> None:
        """``uses_env_reward``: --use_gym_env, an explicit choice over the class's default (None: the class's).
        ``text_only``: the rows carry no images, decided once at set-up; ``run`` then never looks for them."""
        self.infer_engine = infer_engine
        self.max_turns = max_turns
        self.text_only = text_only
        if uses_env_reward is not None:
            self.uses_env_reward = uses_env_reward
        self.options = kwargs  # the rest of the rollout options, for subclasses

    @property
    def tokenizer(self):
        return getattr(self.infer_engine, "tokenizer", None)

    async def on_trajectory_start(self, requests: list[RolloutInferRequest]) -> None:
        """Hook before the first turn; may edit the requests in place (e.g. inject an environment's observation)."""

    async def on_turn_end(self, infer_request, response_choice, current_turn: int) -> dict:
        """Hook after each assistant turn: may return {'done': bool, 'rollout_infos': dict}."""
        return {}

    async def run(
        self, infer_request: RolloutInferRequest, request_config: RequestConfig, **kwargs
    ) -> RolloutOutput | list[RolloutOutput]:
        changed = await self._start(infer_request)
        response = await self.infer_engine.infer_async(infer_request, request_config)
        turn = await self.on_turn_end(infer_request, response.choices[0], 1)
        infos = dict(turn.get("rollout_infos", {}))
        if changed:
            infos["images"] = row_images(infer_request.data_dict)
        return _single_turn_output(infer_request, response, infos)

    async def _start(self, infer_request: RolloutInferRequest) -> bool:
        """``on_trajectory_start``; True when it changed the row's images (a text-only run has none to look at)."""
        if self.text_only:
            await self.on_trajectory_start([infer_request])
            return False
        name = type(self).__name__
        take_entry_images(infer_request, name)
        known = row_images(infer_request.data_dict)
        infer_request.images = list(known)  # ms-swift's field while the hook runs (turn_images.py)
        await self.on_trajectory_start([infer_request])
        return take_start_images(infer_request, known, f"{name}.on_trajectory_start")

    async def async_infer(
        self, requests: Sequence[RolloutInferRequest], request_config: RequestConfig
    ) -> list[RolloutOutput]:
        """Run every request's trajectory concurrently; flatten outputs, tagged with request/prompt ids."""
        if request_config.n != 1:
            raise ValueError("schedulers sample one trajectory per request; repeat the request instead of n > 1")
        results = await asyncio.gather(*(self._run_one(r, request_config) for r in requests))
        return [o for outs in results for o in outs]

    async def _run_one(self, request: RolloutInferRequest, config: RequestConfig) -> list[RolloutOutput]:
        result = await self.run(request, config)
        return _tag(result if isinstance(result, list) else [result], request)


def _single_turn_output(
    request: RolloutInferRequest, response: ChatCompletionResponse, rollout_infos: dict
) -> RolloutOutput:
    choice = response.choices[0]
    lps = choice_logprobs(choice)
    return RolloutOutput(
        response=response,
        messages=[*request.messages, {"role": "assistant", "content": choice.message["content"]}],
        response_token_ids=[choice.token_ids],
        response_loss_mask=[[1] * len(choice.token_ids)],
        rollout_infos={**rollout_infos, "num_turns": 1},
        rollout_logprobs=[lps] if lps else [],
    )


def _tag(outputs: list[RolloutOutput], request: RolloutInferRequest) -> list[RolloutOutput]:
    for o in outputs:
        o.request_id = o.request_id or request.request_id
        o.prompt_id = o.prompt_id or request.prompt_id
        if o.prompt_messages is None:
            o.prompt_messages = request.messages  # edited in place by on_trajectory_start, if at all
    return outputs


def run_trajectories(
    scheduler: RolloutScheduler, requests: Sequence[RolloutInferRequest], config: RequestConfig
) -> list[RolloutOutput]:
    """Synchronous entry for the trainer (colocate mode), through ``grpokit.aio.run_sync``."""
    return run_sync(scheduler.async_infer(requests, config))
