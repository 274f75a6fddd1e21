"""Agents as plugins: ``agents`` is the registry ``--agent NAME`` looks names up in.

An agent is ``async def agent(client, row) -> float | None``: ``client`` is an ``openai.AsyncOpenAI`` already
pointed at the episode's own session of the trainer's OpenAI-compatible endpoint (any ``model=`` is served by the
policy), ``row`` the dataset row (``messages`` and the other columns). The return value is the episode's reward;
None leaves it to ``--reward_funcs`` on the transcript. docs/agents.md has the design and examples.

Nothing here imports ``openai``: the package is needed only when an episode runs (the ``agents`` extra).

The internal API other adapters build on (kept stable):

- ``grpokit.agents.episodes``: ``Episode``, ``EpisodeRecorder`` (the sessions, by id and key), ``episode_outputs``
  (an episode's recorded calls as trajectories for the trainer);
- ``grpokit.agents.runner``: ``run_episodes(agent_fn, rows, endpoint, ...)`` and ``episode_client(endpoint,
  episode)`` (the ``AsyncOpenAI`` of one episode);
- ``grpokit.agents.scheduler``: ``AgentScheduler``, the rollout scheduler ``--agent`` plugs in.
"""

from __future__ import annotations

from grpokit.registry import Registry

agents = Registry("agent", "--agent")

__all__ = ["agents"]
