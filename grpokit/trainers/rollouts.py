"""The rollout half of training: prompts -> requests -> trajectories (each token tagged with its weight version)
-> rewards, through one call, ``Rollouts.rollout_groups``, that the synchronous loop and the buffer of
asynchronous training (group_buffer.py) both use, taking the engine in turns (``EngineTurns``); what reward
functions receive is ``reward_inputs``. It touches only the engine and the reward functions, never the training
model."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from contextlib import asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from grpokit.aio import run_sync
from grpokit.config.args import AlgorithmArguments, RolloutArguments
from grpokit.distributed.offload import Offloader
from grpokit.protocol import RequestConfig, RolloutInferRequest, RolloutOutput
from grpokit.rewards.calling import RewardLog, RewardLogBook, as_trainer_state, swift_kwargs
from grpokit.rollout.scheduler import run_trajectories
from grpokit.runs.progress import Phases
from grpokit.trainers.prompts import PromptStream
from grpokit.trainers.window import WindowRollout, token_versions, trajectory_images

TURN_POLL_S = 0.005  # how often a rollout call waiting for its turn on the engine looks again


@dataclass
class Rewards:
    """The reward functions and models (``runner``, None with only a gym reward), one name and weight per column
    of the [N, F] scores; ``uses_env_reward``: the scheduler's gym reward is the last column."""

    names: list[str]
    weights: torch.Tensor  # [F]
    runner: Any
    uses_env_reward: bool


@dataclass
class WindowHooks:
    """The callables a ``WindowProducer`` calls where the trainer's hooks apply: the trainer's bound methods for
    the hooks a subclass overrides, None for the others (the producer then runs its own default directly; the
    trainer's default methods are thin entries into the same functions, for ``super()`` calls)."""

    # (model, batch, compute_entropy=False) -> ([B, C] logps, entropies or None): forward.py's plain function unless
    # a subclass overrides _get_per_token_logps_and_entropies or _prepare_model_inputs
    logps: Callable
    progress: Callable[[], dict]  # {"global_step", "max_steps"}: what reward functions get as trainer_state
    generate: Callable | None = None  # (requests) -> outputs
    score: Callable | None = None  # (requests, outputs) -> [N, F]
    prepare_batches: Callable | None = None  # (rows) -> list of mini-batches (RolloutBatch)
    advantages: Callable | None = None  # (rows, rewards_per_func [N_global, F], mini-batches) -> [N_global]
    phases: Phases = field(default_factory=Phases)  # what the progress bar says the loop is doing (progress.py)


class Rollouts:
    """Rolls out and scores groups: ``rollout(prompts)`` on the loop's thread, ``rollout_groups`` from the
    buffer's producers. Overridden trainer hooks are reached through ``hooks``; ``prompts`` (the PromptStream,
    also drawn from by dynamic sampling and the buffer) and ``weights_at`` (the engine's weight version, set by
    the loop) are public, the rest is its own."""

    def __init__(
        self,
        hooks: WindowHooks,
        prompts: PromptStream,
        *,
        scheduler,
        template,
        rewards: Rewards,
        rollout_args: RolloutArguments,
        algorithm: AlgorithmArguments,
        offloader: Offloader | None = None,
        images: bool | None = None,
    ) -> None:
        self.hooks, self.prompts, self.scheduler, self.template = hooks, prompts, scheduler, template
        self._score = hooks.score or (lambda requests, outputs: self.score(requests, outputs, hooks.progress()))
        self.rewards, self.rollout_args, self.algorithm = rewards, rollout_args, algorithm
        self.weights_at = 0  # the engine's weight version: the optimizer step of the last sync (the loop sets it)
        self._turns = EngineTurns()  # the loop's rollouts and the buffer's calls take turns
        self._score_lock, self._hook_lock = threading.Lock(), threading.Lock()
        self.offloader = offloader  # --offload_model/--offload_optimizer: applied around generation only
        self._around_generation = offloader.offloaded if offloader is not None else nullcontext  # decided once
        # decided once, not per request: whether trajectories carry images (a vision-language template, or rows
        # with an images column); a text-only run never looks for them
        self.images = bool(getattr(template, "multimodal", False)) if images is None else images
        self.request_config = RequestConfig(
            n=1,
            max_tokens=rollout_args.max_completion_length,
            temperature=rollout_args.temperature,
            top_p=rollout_args.top_p,
            top_k=rollout_args.top_k,
            repetition_penalty=rollout_args.repetition_penalty,
            stop=list(rollout_args.stop_words),
            logprobs=bool(
                algorithm.rollout_importance_sampling_mode
                or rollout_args.async_generate
                or algorithm.use_rollout_logprobs  # the behaviour policy's, for the ratio or the mask
                or algorithm.off_policy_sequence_mask_delta is not None
            ),
            structured_outputs_regex=rollout_args.structured_outputs_regex,
            structured_outputs_json=rollout_args.structured_outputs_json,
        )
        self._reward_logs = RewardLogBook()  # log_extra / log_metric records until their window is built

    # -- the rollout: engine and rewards only (safe beside training) ----------------------------------------
    def rollout(self, prompts: list[dict], version: int | None = None) -> WindowRollout:
        """The loop's own rollout (the synchronous loop's window, a dynamic-sampling round): ``rollout_groups``
        on this thread, with the engine to itself."""
        return run_sync(self.rollout_groups(prompts, version))

    async def rollout_groups(
        self,
        prompts: list[dict],
        version: int | None = None,
        *,
        server: int | None = None,
        beside: Executor | None = None,
    ) -> WindowRollout:
        """Roll out these groups (one per prompt) at weight version ``version`` (default: the engine's now) and
        score them: the one rollout call, of the synchronous loop and of the buffer of asynchronous training
        (group_buffer.py). Touches only the engine and the rewards, never the training model. ``beside``: the
        buffer's calls share the engine (``EngineTurns`` below) and score in that executor, so that the calls still in
        flight go on; ``server``: a --stream_groups producer's own rollout server."""
        t0 = time.perf_counter()
        self.hooks.phases.set("rollout")  # the loop's phase: a background call is ignored
        requests = self.requests(prompts)
        async with self._turns.hold(exclusive=beside is None):
            with self._around_generation() if beside is None else nullcontext():  # --offload_*: CPU meanwhile
                version = self.weights_at if version is None else version
                outputs = self.tag(await self._generate_async(requests, server), version)
        t1 = time.perf_counter()
        self.hooks.phases.set("reward")
        if beside is None:
            rewards_per_func = self.rewards_of(requests, outputs)
        else:
            loop = asyncio.get_running_loop()
            rewards_per_func = await loop.run_in_executor(beside, self.rewards_of, requests, outputs)
        return WindowRollout(
            requests, outputs, rewards_per_func, {"rollout": t1 - t0, "reward": time.perf_counter() - t1}
        )

    def rollout_calls(self, stream_groups: bool) -> list[Callable]:
        """The buffer's producers, one ``rollout_groups`` each: with --stream_groups one per rollout server where
        the scheduler has several (each sends its groups to its own); else one. A ``_generate_completions``
        override is one producer."""
        servers = getattr(self.scheduler, "num_servers", 1) if self.hooks.generate is None and stream_groups else 1
        if servers > 1:
            return [partial(self.rollout_groups, server=i) for i in range(servers)]
        return [self.rollout_groups]

    async def _generate_async(self, requests: list[RolloutInferRequest], server: int | None) -> list[RolloutOutput]:
        if self.hooks.generate is not None:  # an override: on a worker thread, its calls taking turns
            return await asyncio.to_thread(self._generate_hook, requests)
        if server is None:
            return await self.scheduler.async_infer(requests, self.request_config)
        return await self.scheduler.async_infer(requests, self.request_config, server=server)

    def _generate_hook(self, requests: list[RolloutInferRequest]) -> list[RolloutOutput]:
        with self._hook_lock:
            return self.hooks.generate(requests)

    @staticmethod
    def tag(outputs: list[RolloutOutput], version: int) -> list[RolloutOutput]:
        """Each token's weight version: the server's tags, else ``version`` (the one its rollout began with)."""
        for o in outputs:
            o.weight_versions = token_versions(o, version)
        return outputs

    def rewards_of(self, requests: list[RolloutInferRequest], outputs: list[RolloutOutput]) -> torch.Tensor:
        """[N, F] rewards through the trainer's ``_score_completions`` where overridden, else ``score``; the
        reward functions see one call at a time."""
        with self._score_lock:
            return self._score(requests, outputs)

    def requests(self, prompts: list[dict]) -> list[RolloutInferRequest]:
        """num_generations requests per prompt; the row's other columns travel as ``data_dict``."""
        out = []
        for row in prompts:
            data = {k: v for k, v in row.items() if k not in ("messages", "_prompt_index")}
            for _ in range(self.rollout_args.num_generations):
                out.append(
                    RolloutInferRequest(
                        messages=self.template.with_system(row["messages"]),
                        data_dict=data,
                        prompt_id=str(row["_prompt_index"]),
                    )
                )
        return out

    def generate(self, requests: list[RolloutInferRequest]) -> list[RolloutOutput]:
        """Trajectories through the scheduler (which drives the engine or a rollout client)."""
        return run_trajectories(self.scheduler, requests, self.request_config)

    def score(self, requests, outputs: list[RolloutOutput], trainer_state: Any) -> torch.Tensor:
        """[N, F] rewards (NaN = not scored) from every reward function and model; gym rewards as a last column."""
        completions, kwargs = reward_inputs(requests, outputs, trainer_state, images=self.images)
        runner, log = self.rewards.runner, RewardLog(len(outputs))
        scores = runner.compute(completions, kwargs, log) if runner else torch.zeros(len(outputs), 0)
        self._reward_logs.add([o.request_id for o in outputs], log)
        if self.rewards.uses_env_reward:
            env = torch.tensor([float(o.rollout_infos.get("total_reward", float("nan"))) for o in outputs])
            scores = torch.cat([scores, env.unsqueeze(1)], dim=1)
        return scores


class EngineTurns:
    """Who drives the rollout engine. The loop's own rollout (the synchronous loop's window, a dynamic-sampling
    round) has the engine to itself; the calls of the buffer of asynchronous training share it, any number at once
    (one engine batches the requests that arrive together). A rollout of the loop waits for the buffer's calls
    running to end, and holds back new ones meanwhile, so that the two never drive the engine at the same time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shared = 0  # the buffer's calls driving the engine now
        self._exclusive = False
        self._waiting = 0  # the loop's rollouts waiting: no new shared call starts before them

    @asynccontextmanager
    async def hold(self, *, exclusive: bool) -> AsyncIterator[None]:
        """The engine for one rollout call: to itself (``exclusive``, the loop's) or shared (the buffer's)."""
        if exclusive:
            with self._lock:
                self._waiting += 1
        try:
            while not self._try(exclusive):
                await asyncio.sleep(TURN_POLL_S)
        finally:
            if exclusive:
                with self._lock:
                    self._waiting -= 1
        try:
            yield
        finally:
            with self._lock:
                if exclusive:
                    self._exclusive = False
                else:
                    self._shared -= 1

    def _try(self, exclusive: bool) -> bool:
        with self._lock:
            if self._exclusive or (exclusive and self._shared) or (not exclusive and self._waiting):
                return False
            if exclusive:
                self._exclusive = True
            else:
                self._shared += 1
            return True


def reward_inputs(
    requests: list[RolloutInferRequest], outputs: list[RolloutOutput], trainer_state: Any, *, images: bool
) -> tuple[list[str], dict[str, Any]]:
    """The completions (each trajectory's last assistant message) and the reward functions' keyword arguments;
    ``images``: whether trajectories may carry images (decided once per run)."""
    by_id = {r.request_id: r for r in requests}
    completions = [
        o.messages[-1]["content"]
        if o.messages and o.messages[-1]["role"] == "assistant"
        else o.response.choices[0].message["content"]
        for o in outputs
    ]
    kwargs: dict[str, Any] = {}
    for col in {k for r in requests for k in r.data_dict}:
        kwargs[col] = [by_id[o.request_id].data_dict.get(col) for o in outputs]
    # the row's images, then later turns'
    imgs_of = [trajectory_images(o, by_id) if images else [] for o in outputs]
    if any(imgs_of):  # as ms-swift: a trajectory's images replace the row's column
        kwargs["images"] = imgs_of
    token_ids = [[t for seg in o.response_token_ids for t in seg] for o in outputs]
    trajectories: dict[str, list[dict]] = {}  # ms-swift's trajectory_inputs: every output (round) of a request
    for o, imgs in zip(outputs, imgs_of):
        row = swift_kwargs(by_id[o.request_id].data_dict)  # the dataset columns, no hidden ones
        trajectories.setdefault(o.request_id, []).append(
            {**row, **({"images": imgs} if imgs else {}), "messages": o.messages, "rollout_infos": o.rollout_infos}
        )
    kwargs.update(
        messages=[o.messages for o in outputs],
        response_token_ids=token_ids,
        completion_ids=token_ids,
        rollout_infos=[o.rollout_infos for o in outputs],
        finish_reason=[o.response.choices[0].finish_reason for o in outputs],
        is_truncated=[o.response.choices[0].finish_reason == "length" for o in outputs],
        num_turns=[o.rollout_infos.get("num_turns", 1) for o in outputs],
        trainer_state=as_trainer_state(trainer_state),
        prompts=[o.prompt_messages or by_id[o.request_id].messages for o in outputs],
        request_id=[o.request_id for o in outputs],
        trajectory_inputs=trajectories,
    )
    return completions, kwargs
