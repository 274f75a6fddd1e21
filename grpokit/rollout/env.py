"""Gym-style environments for ``gym_scheduler`` and the ``envs`` registry that ``--gym_env`` names are looked up in.

An ``Env`` is made once per trajectory from the row's ``env_config`` (``data_dict['env_config']``). The scheduler
calls ``reset`` before the first turn, ``step`` after every assistant turn, and ``close`` when the trajectory
ends (also when it failed). Rewards travel to the trainer through ``rollout_infos['total_reward']``, which the
trainer adds as the ``gym_reward`` column. Methods may be ``async`` (preferred) or plain functions.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from typing import Any

from grpokit.errors import ConfigError
from grpokit.registry import Registry
from grpokit.protocol import RolloutInferRequest

envs = Registry("gym environment", "--gym_env")


class Env(ABC):
    """One episode of an environment. ``env_config`` is the row's ``env_config`` dict (may be empty)."""

    def __init__(self, env_config: dict[str, Any] | None = None) -> None:
        self.env_config = dict(env_config or {})

    @abstractmethod
    async def reset(self, config: RolloutInferRequest) -> tuple[str, dict[str, Any]]:
        """Start the episode for this request. Returns (observation, info); a non-empty observation is added to
        the prompt as user text, info (JSON-serialisable) lands in ``rollout_infos['reset_info']``."""

    @abstractmethod
    async def step(self, action: list[dict[str, Any]]) -> tuple[str, float, bool, dict[str, Any]]:
        """React to the conversation so far (``action[-1]`` is the model's reply).
        Returns (observation for the next user turn, reward for this step, done, info)."""

    async def close(self) -> None:
        """Release what the episode holds (processes, sockets). Default: nothing."""


GUESS_LOW, GUESS_HIGH = 1, 16
_INT_RE = re.compile(r"-?\d+")


class GuessNumberEnv(Env):
    """Guess a secret integer: the env answers higher / lower / correct; reward 1 for the correct guess.

    ``env_config``: ``secret`` (required int), ``low``/``high`` (default 1..16). The guess is the last integer in
    the reply; a reply without one gets a reminder and reward 0.
    """

    def __init__(self, env_config: dict[str, Any] | None = None) -> None:
        super().__init__(env_config)
        secret = self.env_config.get("secret")
        if isinstance(secret, bool) or not isinstance(secret, int):
            raise ConfigError(f"guess_number env: env_config needs an integer 'secret', got {secret!r} "
                              "(e.g. {\"name\": \"guess_number\", \"secret\": 7})")
        self.secret = secret
        self.low = int(self.env_config.get("low", GUESS_LOW))
        self.high = int(self.env_config.get("high", GUESS_HIGH))
        self.guesses: list[int] = []

    async def reset(self, config: RolloutInferRequest) -> tuple[str, dict[str, Any]]:
        """The instructions, unless the row's prompt already holds a user message (it then carries them)."""
        has_user = any(m["role"] == "user" for m in config.messages)
        text = "" if has_user else (f"I am thinking of a number between {self.low} and {self.high}. "
                                    "Guess it; reply with just the number.")
        return text, {"low": self.low, "high": self.high}

    async def step(self, action: list[dict[str, Any]]) -> tuple[str, float, bool, dict[str, Any]]:
        reply = str(action[-1].get("content") or "")
        found = _INT_RE.findall(reply)
        if not found:
            return f"Reply with one whole number between {self.low} and {self.high}.", 0.0, False, {"guess": None}
        guess = int(found[-1])
        self.guesses.append(guess)
        info = {"guess": guess, "tries": len(self.guesses)}
        if guess < self.secret:
            return f"{guess} is too low. Guess higher.", 0.0, False, info
        if guess > self.secret:
            return f"{guess} is too high. Guess lower.", 0.0, False, info
        return f"{guess} is correct!", 1.0, True, info


envs["guess_number"] = GuessNumberEnv
