"""What one episode may cost, checked before the engine does any work for a call.

An agent is code the trainer runs but does not trust to be frugal: a loop of calls, ``n`` = 64 on every call, a
history that grows without end. Each episode holds an ``EpisodeBudget``: its calls, the trajectories they start
(each is a row of the training batch), the tokens they may use (every prompt plus ``n`` × ``max_tokens``,
reserved before sampling), and the characters of messages it keeps for the transcript. A call that would pass
one is refused (400, the limit named) and nothing of it is sampled or kept. Every prompt an episode samples on
(a call that continues an earlier reply included) must fit ``--max_length`` and the model's context; a prompt
whose text is too long for that whatever its tokenization (no token spells more than the vocabulary's longest)
is refused before it is tokenized (``check_prompt_chars``).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

from grpokit.agents.chat import ChatError
from grpokit.template.encode import KWARGS_KEY, TOOLS_KEY

MAX_EXTRA_CHARS = 65536  # a message's fields beside role and content, as the rollout server bounds them


@dataclass(frozen=True)
class EpisodeBudget:
    calls: int = 64
    trajectories: int = 8  # rows of the training batch one episode may bring (choices that extend nothing)
    tokens: int = 1 << 20  # prompt tokens plus n x max_tokens, over every call
    retained_chars: int = 32 << 20  # characters of the messages kept for the transcript, over every call


@dataclass
class Usage:
    calls: int = 0
    trajectories: int = 0
    tokens: int = 0
    retained_chars: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def reserve(self, budget: EpisodeBudget, **asked: int) -> None:
        """Add ``asked`` (calls=, trajectories=, tokens=, retained_chars=) or, when one would pass ``budget``,
        nothing: ChatError (400) naming it."""
        with self.lock:
            for name, n in asked.items():
                if getattr(self, name) + n > getattr(budget, name):
                    raise ChatError(
                        400,
                        f"this episode's budget of {getattr(budget, name)} {name.replace('_', ' ')} is spent "
                        f"({getattr(self, name)} used, this call needs {n}); end the episode, or ask for "
                        "fewer choices and shorter histories",
                    )
            for name, n in asked.items():
                setattr(self, name, getattr(self, name) + n)


def message_chars(messages: list[dict]) -> tuple[int, int]:
    """(characters of the contents, characters of everything kept) of a call's messages; ChatError (413) for a
    message whose fields beside role and content are longer than ``MAX_EXTRA_CHARS``."""
    content, total = 0, 0
    for i, m in enumerate(messages):
        text = m.get("content")
        content += len(text) if isinstance(text, str) else 0
        extra = {k: v for k, v in m.items() if k not in ("role", "content", TOOLS_KEY, KWARGS_KEY)}
        size = len(json.dumps(extra, ensure_ascii=False)) if extra else 0
        carried = sum(len(m[k]) for k in (TOOLS_KEY, KWARGS_KEY) if isinstance(m.get(k), str))  # the call's tools
        total += carried  # (bounded by the body's own limits: 128 tools)
        if size > MAX_EXTRA_CHARS:
            raise ChatError(
                413,
                f"messages[{i}]: its fields beside role and content ({', '.join(map(str, extra))[:80]}) hold "
                f"{size} characters, more than {MAX_EXTRA_CHARS}; send less",
            )
        content += sum(len(c["function"]["arguments"]) for c in _text_calls(m))
        total += size + (len(text) if isinstance(text, str) else 0)
    return content, total


def _text_calls(m: dict) -> list[dict]:
    calls = m.get("tool_calls") or []
    functions = [c.get("function") for c in calls if isinstance(c, dict)]
    return [{"function": f} for f in functions if isinstance(f, dict) and isinstance(f.get("arguments"), str)]


def check_prompt_chars(chars: int, limit: int, max_token_chars: int, what: str) -> None:
    """ChatError (400) when ``chars`` characters cannot fit ``limit`` tokens whatever the tokenization."""
    if chars > limit * max_token_chars:
        raise ChatError(
            400,
            f"the prompt's {chars} characters are at least {-(-chars // max_token_chars)} tokens, more than "
            f"{what} {limit}; send a shorter history",
        )


def check_prompt_tokens(tokens: int, limit: int, what: str, continued: bool) -> None:
    """ChatError (400) when a prompt of ``tokens`` leaves no room for one sampled token within ``limit``."""
    if tokens >= limit:
        chained = " (it continues earlier replies, whose tokens it keeps)" if continued else ""
        raise ChatError(
            400,
            f"the prompt is {tokens} tokens{chained}, leaving no room to sample within {what} {limit}; start "
            "a shorter conversation",
        )
