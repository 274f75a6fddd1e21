"""Episodes: one agent run's calls, recorded token-in-token-out, and the trajectories they train as.

Every call of an episode is recorded as the engine ran it: the prompt ids as rendered, each choice's sampled ids
and logprobs, the policy version (windows trained before the call). A call *extends* an earlier choice when its
messages are that call's messages, then the choice's reply as the endpoint returned it (its raw text: the
endpoint puts the sampled text back in place of the parsed ``content``/``tool_calls``, see ``restore_replies``),
then messages of other roles (tool results, user turns). Such a call is sampled on the earlier prompt ids + the
choice's sampled ids + the chat template's tokens for what follows (``ChatTemplate.encode_between``), so the
model never sees a re-tokenised history; the chain of calls becomes one trajectory: the sampled tokens train, the
tokens between them (tool results, headers) are masked. A call that extends nothing (the agent rewrote, dropped
or summarised its history, or a choice was already continued by another call) starts a trajectory of its own: its
prompt is rendered afresh. Each choice trains exactly once.
"""

from __future__ import annotations

import json
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

from grpokit.agents.budget import EpisodeBudget, Usage
from grpokit.errors import RolloutError
from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RolloutOutput

STATUSES = ("running", "done", "failed", "timeout")


@dataclass
class ChoiceRecord:
    token_ids: list[int]
    logprobs: list[float]
    text: str  # the sampled text (the engine's decoding), what the trainer's transcript holds
    finish_reason: str
    reply: dict  # the assistant message returned to the agent (tool calls parsed)


@dataclass
class CallRecord:
    index: int
    messages: list[dict]  # as rendered: the template's form, replies restored to their raw text, tools carried
    prompt_ids: list[int]
    choices: list[ChoiceRecord]
    policy_version: int
    parent: tuple[int, int] | None = None  # (call, choice) this call extends
    between_ids: list[int] = field(default_factory=list)  # the template's tokens after the parent's choice


@dataclass
class Episode:
    """One agent run: its session (``id``, ``key``), the dataset row, the calls, the outcome, and what it may
    still cost (``budget``, ``usage``: grpokit/agents/budget.py)."""

    row: dict
    id: str = field(default_factory=lambda: secrets.token_urlsafe(18))  # unguessable: nobody can list episodes
    key: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    budget: EpisodeBudget = field(default_factory=EpisodeBudget)
    usage: Usage = field(default_factory=Usage, repr=False)
    calls: list[CallRecord] = field(default_factory=list)
    reward: float | None = None
    status: str = "running"
    error: str | None = None
    prompt_id: str = ""
    request_id: str = ""
    ended: threading.Event = field(default_factory=threading.Event, repr=False)  # set by finish(): calls still
    # generating stop at their next token (grpokit.agents.engine.CANCEL)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _continued: set = field(default_factory=set, repr=False)

    @property
    def open(self) -> bool:
        return self.status == "running"

    def restore_replies(self, messages: list[dict]) -> list[dict]:
        """``messages`` with each assistant message that equals a reply of this episode (content and tool calls
        as returned) put back as the raw text that was sampled."""
        with self._lock:
            known = [(_reply_key(c.reply), c.text) for call in self.calls for c in call.choices]
        if not known:
            return messages
        out = []
        for m in messages:
            if m.get("role") == "assistant":
                key = _reply_key(m)
                text = next((t for k, t in known if k == key), None)
                if text is not None:
                    m = {"role": "assistant", "content": text}
            out.append(m)
        return out

    def plan(self, messages: list[dict], template, n: int = 1) -> tuple[list[int], tuple[int, int] | None, list[int]]:
        """(prompt ids, the choice this call extends or None, the tokens between them) for a call's messages.
        A call of ``n`` > 1 choices extends nothing: each of its choices is then the root of its own chain."""
        if n == 1 and messages[-1]["role"] != "assistant":
            with self._lock:
                candidates = [
                    (call, k)
                    for call in reversed(self.calls)
                    for k in range(len(call.choices))
                    if (call.index, k) not in self._continued and call.messages[-1]["role"] != "assistant"
                ]
            for call, k in candidates:
                choice = call.choices[k]
                base = [*call.messages, {"role": "assistant", "content": choice.text}]
                if len(messages) <= len(base) or messages[: len(base)] != base:
                    continue
                if any(m["role"] == "assistant" for m in messages[len(base) :]):
                    continue
                try:
                    between = template.encode_between(messages, len(base) - 1, len(messages), choice.token_ids)
                except RolloutError:  # the template rewrites earlier turns: render afresh
                    break
                return [*call.prompt_ids, *choice.token_ids, *between], (call.index, k), between
        return template.encode_prompt(messages), None, []

    def record(
        self,
        messages: list[dict],
        prompt_ids: list[int],
        choices: list[ChoiceRecord],
        version: int,
        parent: tuple[int, int] | None,
        between: list[int],
    ) -> CallRecord:
        """Add a finished call; RolloutError when the episode has ended meanwhile (its calls are final)."""
        with self._lock:
            if self.status != "running":
                raise RolloutError(f"episode {self.id} ended ({self.status}) while this call ran")
            if parent is not None and parent in self._continued:  # two calls raced to extend one choice
                parent, between = None, []
            if parent is not None:
                self._continued.add(parent)
            call = CallRecord(len(self.calls), messages, prompt_ids, choices, version, parent, between)
            self.calls.append(call)
            return call

    def finish(self, status: str, reward: float | None = None, error: str | None = None) -> None:
        with self._lock:
            self.status, self.reward, self.error = status, reward, error
        self.ended.set()


def _reply_key(m: dict) -> tuple:
    calls = tuple(
        (c.get("function", {}).get("name"), _args_text(c.get("function", {}).get("arguments")))
        for c in m.get("tool_calls") or []
    )
    return (m.get("content") or "", calls)


def _args_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args)


class EpisodeRecorder:
    """The open sessions: an episode is reached by its id (``/episodes/<id>/v1``) with its key as the bearer
    token; it ends when its agent returns, raises or times out, after which its calls are refused (410)."""

    def __init__(self, budget: EpisodeBudget | None = None) -> None:
        self._episodes: dict[str, Episode] = {}
        self._lock = threading.Lock()
        self.budget = budget or EpisodeBudget()

    def open(self, row: dict, prompt_id: str = "", request_id: str = "") -> Episode:
        episode = Episode(row=row, prompt_id=prompt_id, request_id=request_id, budget=self.budget)
        with self._lock:
            self._episodes[episode.id] = episode
        return episode

    def get(self, episode_id: str) -> Episode | None:
        with self._lock:
            return self._episodes.get(episode_id)

    def close(self, episode: Episode) -> None:
        """Forget the episode (its record stays with the caller)."""
        with self._lock:
            self._episodes.pop(episode.id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._episodes)


def episode_outputs(episode: Episode, train: bool = True) -> list[RolloutOutput]:
    """The episode's trajectories, one per chain of calls (module docstring), each with its sampled ids trained
    (mask 1; 0 everywhere when ``train`` is false) and the template's tokens between them masked. An episode
    without calls gives one empty trajectory on the row's prompt. ``rollout_infos['total_reward']`` is the
    agent's reward where it gave one."""
    infos = {"episode_id": episode.id, "agent_status": episode.status, "agent_calls": len(episode.calls)}
    if episode.error:
        infos["agent_error"] = episode.error[:500]
    if episode.reward is not None:
        infos["total_reward"] = float(episode.reward)
    chains = _chains(episode)
    if not chains:
        messages = list(episode.row.get("messages") or [{"role": "user", "content": ""}])
        choice = ChatCompletionResponseChoice(
            message={"role": "assistant", "content": ""}, finish_reason="stop", token_ids=[]
        )
        return [
            RolloutOutput(
                response=ChatCompletionResponse(choices=[choice]),
                prompt_messages=messages,
                messages=[*messages, {"role": "assistant", "content": ""}],
                response_token_ids=[[]],
                response_loss_mask=[[]],
                rollout_infos={**infos, "num_turns": 0, "agent_segments": 0},
            )
        ]
    out = []
    for chain in chains:
        root, (last, k) = episode.calls[chain[0][0]], chain[-1]
        leaf_call, leaf = episode.calls[last], episode.calls[last].choices[k]
        segments = [episode.calls[c].choices[j] for c, j in chain]
        messages = _transcript(leaf_call.messages, leaf.text)
        lps = [s.logprobs for s in segments]
        choice = ChatCompletionResponseChoice(
            message={"role": "assistant", "content": leaf.text},
            finish_reason="length" if leaf.finish_reason == "length" else "stop",
            token_ids=leaf.token_ids,
        )
        out.append(
            RolloutOutput(
                response=ChatCompletionResponse(choices=[choice], prompt_token_ids=leaf_call.prompt_ids),
                prompt_messages=root.messages,
                messages=messages,
                response_token_ids=[list(s.token_ids) for s in segments],
                response_loss_mask=[[int(train)] * len(s.token_ids) for s in segments],
                rollout_logprobs=lps
                if train and all(len(lp) == len(s.token_ids) for lp, s in zip(lps, segments))
                else [],
                rollout_infos={
                    **infos,
                    "num_turns": len(chain),
                    "agent_segments": len(chains),
                    "policy_versions": [episode.calls[c].policy_version for c, _ in chain],
                },
            )
        )
    return out


def _transcript(messages: list[dict], text: str) -> list[dict]:
    """A call's messages with its reply appended (a prefilled last assistant message is extended)."""
    if messages and messages[-1]["role"] == "assistant":
        return [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + text}]
    return [*messages, {"role": "assistant", "content": text}]


def _chains(episode: Episode) -> list[list[tuple[int, int]]]:
    """Root-to-leaf paths of (call, choice): a choice nobody extended ends a chain."""
    child: dict[tuple[int, int], int] = {c.parent: c.index for c in episode.calls if c.parent is not None}
    chains = []
    for call in episode.calls:
        if call.parent is not None:
            continue
        for k in range(len(call.choices)):
            path, node = [], (call.index, k)
            while True:
                path.append(node)
                nxt = child.get(node)
                if nxt is None:
                    break
                node = (nxt, 0)  # a call that extends a choice has one choice (Episode.plan)
            chains.append(path)
    return chains
