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

from grpokit.data.images import IMAGE_PLACEHOLDER, check_image_ref
from grpokit.errors import ConfigError, DataError
from grpokit.protocol import RolloutInferRequest
from grpokit.registry import Registry

envs = Registry("gym environment", "--gym_env")


class Env(ABC):
    """One episode of an environment. ``env_config`` is the row's ``env_config`` dict (may be empty)."""

    def __init__(self, env_config: dict[str, Any] | None = None) -> None:
        self.env_config = dict(env_config or {})

    @abstractmethod
    async def reset(self, config: RolloutInferRequest) -> tuple[str, dict[str, Any], str]:
        """Start the episode for this request. Returns (observation, info, system_message), as in ms-swift;
        (observation, info) is accepted too. As in ms-swift the env's messages replace the row's prompt: a
        non-empty observation replaces its user/assistant messages with one user message, a non-empty system
        message replaces its system message; an empty one keeps the row's. ``info`` (JSON-serialisable) lands in
        ``rollout_infos['reset_info']``. An image observation (vision-language models) puts one ``<image>``
        placeholder per image in the observation and the images (paths, bytes or PIL images) in ``info['images']``,
        as ``step`` does; they follow the row's images in the trajectory (and are not part of ``reset_info``)."""

    @abstractmethod
    async def step(self, action: list[dict[str, Any]]) -> tuple[str, float, bool, dict[str, Any]]:
        """React to the conversation so far (``action[-1]`` is the model's reply).
        Returns (observation for the next user turn, reward for this step, done, info). An image observation
        (vision-language models) puts one ``<image>`` placeholder per image in the observation and the images
        (paths, bytes or PIL images) in ``info['images']``."""

    async def close(self) -> None:
        """Release what the episode holds (processes, sockets). Default: nothing."""


def reset_values(ret: Any, name: str) -> tuple[str, dict[str, Any], str]:
    """(observation, info, system_message) from what ``Env.reset`` returned: 3 values (ms-swift) or 2 (info
    and system message default to empty). ValueError naming the env for anything else."""
    if not isinstance(ret, (tuple, list)) or len(ret) not in (2, 3):
        got = f"{len(ret)} values" if isinstance(ret, (tuple, list)) else type(ret).__name__
        raise ValueError(
            f"env {name!r}: reset must return (observation, info, system_message) or (observation, info), got {got}"
        )
    observation, info, system = (*ret, "") if len(ret) == 2 else ret
    if observation is not None and not isinstance(observation, str):
        raise ValueError(f"env {name!r}: reset's observation must be a string, got {type(observation).__name__}")
    if system is not None and not isinstance(system, str):
        raise ValueError(f"env {name!r}: reset's system_message must be a string, got {type(system).__name__}")
    if info is not None and not isinstance(info, dict):
        raise ValueError(f"env {name!r}: reset's info must be a dict, got {type(info).__name__}")
    return observation or "", dict(info or {}), system or ""


def reset_images(info: dict[str, Any], observation: str, name: str) -> list:
    """The images of reset's observation, taken out of ``info`` (``info['images']``: a list of paths, bytes or PIL
    images, one per ``<image>`` of the observation). ValueError naming the env otherwise."""
    images = info.pop("images", None)
    if images is None:
        return []
    if not isinstance(images, (list, tuple)):
        raise ValueError(f"env {name!r}: reset's info['images'] must be a list of images, got {type(images).__name__}")
    for k, image in enumerate(images):
        try:
            check_image_ref(image, f"env {name!r}: reset's image {k}")
        except DataError as e:
            raise ValueError(str(e)) from None
    slots = observation.count(IMAGE_PLACEHOLDER)
    if images and slots != len(images):
        raise ValueError(
            f"env {name!r}: reset returned {len(images)} image(s) but its observation holds {slots} "
            f"{IMAGE_PLACEHOLDER} placeholder(s); put one {IMAGE_PLACEHOLDER} per image in the "
            "observation"
        )
    return list(images)


def start_messages(prompt: list[dict[str, Any]], observation: str, system: str) -> list[dict[str, Any]]:
    """The trajectory's first messages (ms-swift's replacement): ``[system, user: observation]``, each part
    taken from the row's prompt when the env gave none."""
    row_system = [m for m in prompt if m["role"] == "system"]
    rest = [m for m in prompt if m["role"] != "system"]
    head = [{"role": "system", "content": system}] if system else row_system
    return head + ([{"role": "user", "content": observation}] if observation else rest)


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
            raise ConfigError(
                f"guess_number env: env_config needs an integer 'secret', got {secret!r} "
                '(e.g. {"name": "guess_number", "secret": 7})'
            )
        self.secret = secret
        self.low = int(self.env_config.get("low", GUESS_LOW))
        self.high = int(self.env_config.get("high", GUESS_HIGH))
        self.guesses: list[int] = []

    async def reset(self, config: RolloutInferRequest) -> tuple[str, dict[str, Any], str]:
        """The instructions, unless the row's prompt already holds a user message (an empty observation keeps
        it); no system message of its own."""
        has_user = any(m["role"] == "user" for m in config.messages)
        text = (
            ""
            if has_user
            else (
                f"I am thinking of a number between {self.low} and {self.high}. Guess it; reply with just the number."
            )
        )
        return text, {"low": self.low, "high": self.high}, ""

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
