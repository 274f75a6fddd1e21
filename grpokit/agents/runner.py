"""Running agents: one episode per (agent, row), concurrent and bounded, each cut off at its timeout.

``endpoint`` is anything with a ``recorder`` (an ``EpisodeRecorder``) and ``base_url(episode)``: the trainer's
``grpokit.server.openai_routes.LocalEndpoint``. An agent's exception or timeout ends its episode as ``failed`` or
``timeout`` (reward 0, nothing of it trained), never the run. An agent that blocks the event loop (a synchronous
``time.sleep``, a blocking socket) cannot be cut off: agents must await their I/O. A watcher thread says so: a loop
that has not turned for ``BLOCKED_S`` seconds while episodes run gets a warning naming the agent.
"""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from grpokit.agents.episodes import Episode

logger = logging.getLogger(__name__)
AgentFn = Callable[[Any, dict], Awaitable[float | None]]
BLOCKED_S = 2.0  # a loop that has not turned for this long is blocked by an agent


def episode_client(endpoint, episode: Episode, timeout: float | None = None):
    """An ``openai.AsyncOpenAI`` pointed at the episode's session: its base URL, its key; no retries (a call is
    recorded once)."""
    from openai import AsyncOpenAI  # the 'agents' extra: only a run that plays episodes needs it

    return AsyncOpenAI(base_url=endpoint.base_url(episode), api_key=episode.key, max_retries=0, timeout=timeout)


def checked_reward(value: Any, name: str) -> float | None:
    """An agent's return value as a reward: a finite real number, or None; ValueError otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(
            f"agent {name!r} returned {type(value).__name__} {str(value)[:40]}; return a finite number "
            "(the episode's reward) or None (score the transcript with --reward_funcs)"
        )
    return float(value)


async def run_episode(
    agent_fn: AgentFn, row: dict, endpoint, *, timeout: float, prompt_id: str = "", request_id: str = ""
) -> Episode:
    """One episode of ``agent_fn`` on ``row``: opened, played, finished (done / failed / timeout), closed."""
    name = getattr(agent_fn, "__name__", type(agent_fn).__name__)
    episode = endpoint.recorder.open(row, prompt_id=prompt_id, request_id=request_id)
    client = episode_client(endpoint, episode, timeout)
    try:
        reward = await asyncio.wait_for(agent_fn(client, row), timeout)
        episode.finish("done", checked_reward(reward, name))
    except asyncio.TimeoutError:
        episode.finish("timeout", 0.0, f"agent {name!r} ran past --agent_timeout {timeout:g} s")
    except Exception as e:  # noqa: BLE001 - the agent's own bug ends its episode, never the run
        episode.finish("failed", 0.0, f"{type(e).__name__}: {e}")
    finally:
        endpoint.recorder.close(episode)
        try:
            await client.close()
        except Exception:  # noqa: BLE001 - the episode is over either way
            logger.debug("closing the client of episode %s failed", episode.id, exc_info=True)
    if episode.status != "done":
        logger.warning("episode %s of agent %r: %s (%s)", episode.id, name, episode.status, (episode.error or "")[:200])
    return episode


async def run_episodes(
    agent_fn: AgentFn,
    rows: Sequence[dict],
    endpoint,
    *,
    concurrency: int,
    timeout: float,
    ids: Sequence[tuple[str, str]] | None = None,
) -> list[Episode]:
    """An episode per row, at most ``concurrency`` at once, in the rows' order; ``ids``: (prompt_id, request_id)
    per row."""
    gate = asyncio.Semaphore(concurrency)
    ids = list(ids) if ids is not None else [("", "")] * len(rows)

    async def one(row: dict, pid: str, rid: str) -> Episode:
        async with gate:
            return await run_episode(agent_fn, row, endpoint, timeout=timeout, prompt_id=pid, request_id=rid)

    turned, done = [time.monotonic()], threading.Event()
    name = getattr(agent_fn, "__name__", type(agent_fn).__name__)
    threading.Thread(target=_warn_when_blocked, args=(turned, done, name), daemon=True).start()
    ticker = asyncio.ensure_future(_tick(turned))
    try:
        return list(await asyncio.gather(*(one(r, p, q) for r, (p, q) in zip(rows, ids, strict=True))))
    finally:
        done.set()
        ticker.cancel()


async def _tick(turned: list[float]) -> None:
    while True:
        turned[0] = time.monotonic()
        await asyncio.sleep(BLOCKED_S / 10)


def _warn_when_blocked(turned: list[float], done: threading.Event, name: str) -> None:
    """Warn once per stall while the loop has not turned for BLOCKED_S seconds (see the module docstring)."""
    warned = 0.0
    while not done.wait(BLOCKED_S / 4):
        stalled = time.monotonic() - turned[0]
        if stalled >= BLOCKED_S and turned[0] != warned:
            warned = turned[0]
            logger.warning(
                "agent %r blocks the event loop (no await for %.1f s): every episode and the trainer's endpoint "
                "wait on it; use await asyncio.sleep / async clients, or run blocking work in asyncio.to_thread",
                name,
                stalled,
            )
