"""``AgentScheduler``: ``--agent NAME`` as a rollout scheduler, so the trainer's window loop is unchanged.

Each request the trainer makes (``num_generations`` per dataset row, one GRPO group per row) is one episode of
the agent against the local OpenAI-compatible endpoint; the episode's calls become its trajectories
(``episode_outputs``). The agent's return value is the episode's reward: it reaches the trainer as the
``gym_reward`` column (``rollout_infos['total_reward']``); None leaves that column NaN, so only ``--reward_funcs``
(scored on the transcript, the row's columns and ``rollout_infos``) count. A failed or timed-out episode gets
reward 0 and trains no token (its mask is 0); ``metrics()`` counts them.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from collections.abc import Callable, Sequence

from grpokit.agents import agents
from grpokit.agents.budget import EpisodeBudget
from grpokit.agents.engine import EpisodeEngine
from grpokit.agents.episodes import EpisodeRecorder, episode_outputs
from grpokit.agents.runner import AgentFn, run_episodes
from grpokit.agents.service import ChatService
from grpokit.errors import ConfigError
from grpokit.protocol import RequestConfig, RolloutInferRequest, RolloutOutput
from grpokit.rollout.scheduler import RolloutScheduler
from grpokit.template.encode import detach

logger = logging.getLogger(__name__)
SERVED_MODEL_NAME = "policy"  # what /v1/models lists; any model= of a call is served by the policy alike


def check_agent_options(rollout_args) -> None:
    """--agent against the options it cannot go with (ConfigError naming both)."""
    r = rollout_args
    if not r.agent:
        return
    if r.multi_turn_scheduler:
        raise ConfigError(
            f"--agent {r.agent} and --multi_turn_scheduler {r.multi_turn_scheduler}: the agent drives "
            "the episode itself; give one of them"
        )
    if r.gym_env:
        raise ConfigError(f"--agent {r.agent} and --gym_env {r.gym_env}: give one of them")
    if r.vllm_mode == "server" and (r.vllm_server_host or r.vllm_server_base_url):
        raise ConfigError(
            f"--agent {r.agent} with --vllm_mode server is not implemented: episodes are recorded by "
            "the trainer's own endpoint over its in-process engine; drop --vllm_mode server"
        )
    if r.use_vllm:
        raise ConfigError(
            f"--agent {r.agent} with --use_vllm true is not implemented (episode calls sample on "
            "planned prompt ids through the transformers engine); drop --use_vllm"
        )


class AgentScheduler(RolloutScheduler):
    """Plays one episode of ``agent_fn`` per request through an endpoint that ``serve(service, recorder)``
    starts on first use (the trainer's ``LocalEndpoint``), over the trainer's engine (``infer_engine``; the
    pipeline hands the trainer a recipe ``engine -> scheduler``, as for the multi-turn schedulers)."""

    uses_env_reward = True  # the agent's return value is the gym_reward column

    def __init__(
        self,
        agent_fn: AgentFn,
        *,
        serve: Callable,
        concurrency: int = 64,
        timeout: float = 600.0,
        infer_engine=None,
        budget: EpisodeBudget | None = None,
    ) -> None:
        super().__init__(infer_engine)
        self.agent_fn, self.serve = agent_fn, serve
        self.concurrency, self.timeout = concurrency, timeout
        self.recorder = EpisodeRecorder(budget)  # what each episode may cost (grpokit/agents/budget.py)
        self.endpoint = None
        self.service: ChatService | None = None
        self.windows = 0  # rollouts started: the policy version an episode's calls are recorded with
        self.totals = {"episodes": 0, "failures": 0, "timeouts": 0, "calls": 0}
        self._last: dict[str, float] = {}

    @classmethod
    def from_args(cls, rollout_args, serve: Callable, infer_engine=None) -> AgentScheduler:
        check_agent_options(rollout_args)
        if importlib.util.find_spec("openai") is None:  # looked up, not imported: the client is made per episode
            raise ConfigError(
                f"--agent {rollout_args.agent}: the agent's client is openai's AsyncOpenAI, and the "
                "openai package is not installed; pip install 'grpokit[agents]'"
            )
        return cls(
            agents.get_or_raise(rollout_args.agent),
            serve=serve,
            concurrency=rollout_args.agent_concurrency,
            timeout=rollout_args.agent_timeout,
            infer_engine=infer_engine,
        )

    def _started(self, config: RequestConfig):
        if self.endpoint is None:
            if self.infer_engine is None:
                raise ConfigError(
                    "AgentScheduler has no engine: the trainer sets infer_engine before the first rollout"
                )
            engine = EpisodeEngine.over(self.infer_engine)
            self.service = ChatService(
                engine,
                SERVED_MODEL_NAME,
                config,
                version=lambda: self.windows - 1,
                context=model_context(engine),
                max_prompt=getattr(engine.template, "max_length", None),
            )
            self.endpoint = self.serve(self.service, self.recorder)
        self.service.defaults = config.model_copy(update={"n": 1, "logprobs": True})
        return self.endpoint

    async def async_infer(
        self, requests: Sequence[RolloutInferRequest], request_config: RequestConfig
    ) -> list[RolloutOutput]:
        """An episode per request, at most --agent_concurrency at once; their trajectories, tagged."""
        endpoint = self._started(request_config)
        self.windows += 1
        rows = [agent_row(r) for r in requests]
        episodes = await run_episodes(
            self.agent_fn,
            rows,
            endpoint,
            concurrency=self.concurrency,
            timeout=self.timeout,
            ids=[(r.prompt_id, r.request_id) for r in requests],
        )
        await self._drained()
        outputs: list[RolloutOutput] = []
        for request, episode in zip(requests, episodes, strict=True):
            for o in episode_outputs(episode, train=episode.status == "done"):
                o.request_id, o.prompt_id = request.request_id, request.prompt_id
                outputs.append(o)
        self._count(episodes)
        return outputs

    async def _drained(self, limit_s: float = 60.0) -> None:
        """Wait for calls still generating (an agent cut off mid-call: its episode's end stops them at the next
        token), so that no generation runs on the weights while they train."""
        waited = 0.0
        while self.service.inflight and waited < limit_s:
            await asyncio.sleep(0.01)
            waited += 0.01
        if self.service.inflight:
            logger.warning(
                "%d endpoint call(s) still generating %g s after their episodes ended", self.service.inflight, limit_s
            )

    def _count(self, episodes) -> None:
        n = len(episodes)
        failures = sum(e.status == "failed" for e in episodes)
        timeouts = sum(e.status == "timeout" for e in episodes)
        calls = sum(len(e.calls) for e in episodes)
        for key, value in (("episodes", n), ("failures", failures), ("timeouts", timeouts), ("calls", calls)):
            self.totals[key] += value
        self._last = {
            "agent/episodes": n,
            "agent/failures": failures,
            "agent/timeouts": timeouts,
            "agent/calls_mean": calls / max(n, 1),
        }
        if failures or timeouts:
            logger.warning(
                "agent episodes of rollout %d: %d failed, %d timed out of %d (trained as reward 0, masked)",
                self.windows,
                failures,
                timeouts,
                n,
            )

    def rollout_metrics(self) -> dict[str, float]:
        """The last rollout's episode counts (``agent/episodes``, ``agent/failures``, ``agent/timeouts``,
        ``agent/calls_mean``), which the trainer logs with the window's metrics (window_producer.py)."""
        return dict(self._last)

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None


def model_context(engine) -> int | None:
    """The positions the engine's model takes (its config's ``max_position_embeddings``), when it says."""
    config = getattr(getattr(engine, "model", None), "config", None)
    n = getattr(config, "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def agent_row(request: RolloutInferRequest) -> dict:
    """The dataset row an agent gets: its columns, ``messages`` without the carried render options, and the
    row's ``tools`` when it had some."""
    messages, tools, _ = detach(request.messages)
    row = {**request.data_dict, "messages": messages}
    if tools:
        row["tools"] = tools
    return row
