"""OpenEnv environments run in the training process: ``--multi_turn_scheduler OpenEnvScheduler`` (ms-swift's name;
``openenv_scheduler`` too) with ``--openenv_env module:Class`` (docs/agents_envs.md).

An OpenEnv environment (``openenv.core.env_server.Environment``: ``reset()`` → observation, ``step(action)`` →
observation with ``reward`` and ``done``) is made once per trajectory, in process: no container, no server. The
turn loop is ``gym_scheduler``'s (this class extends ``GYMScheduler``, as ms-swift's does): ``reset`` before the
first turn (its observation is the first user message), after each reply ``parse_action(text)`` → the env's
``Action`` → ``step`` → ``format_observation(observation)`` as the next user message, until ``done`` or
``--max_turns``. The step rewards add up to ``rollout_infos['total_reward']``, the ``gym_reward`` column.

ms-swift's scheduler talks to an OpenEnv *server* (``env_config.base_url``, a WebSocket client); grpokit runs the
environment's class itself, so a row naming a ``base_url`` is refused with a line saying so. The environment
comes from the row's ``env_config`` (``{"env": "module:Class", "kwargs": {...}, "reset_kwargs": {...}}``), else
``--openenv_env``. The class's ``Action`` type is read from its ``Environment[Action, Observation, State]`` base,
or named in ``env_config.action``. Subclasses override ``parse_action`` / ``format_observation`` as in ms-swift.
``openenv`` is imported only by the environment's own module: this file needs nothing from it.
"""

from __future__ import annotations

import importlib
import inspect
import json
import typing
from typing import Any

from grpokit.errors import ConfigError, DataError
from grpokit.protocol import RolloutInferRequest
from grpokit.rollout.builtin_schedulers import GYMScheduler
from grpokit.rollout.env import Env
from grpokit.rollout.multi_turn import multi_turns
from grpokit.wire.json_text import loads

OPENENV_NAMES = ("OpenEnvScheduler", "openenv_scheduler")
_OBS_BOOKKEEPING = ("done", "reward", "metadata")  # Observation's base fields; the rest is what the model reads


def import_object(path: str, what: str) -> Any:
    """``module:attr`` (or ``module.attr``) → the object; ConfigError naming ``what`` and the fix otherwise."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(
            f"{what} {path!r}: give module:Name (e.g. my_envs:EchoEnvironment); the module is "
            "imported as usual (--external_plugins puts a plugin file's folder on sys.path)"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{what} {path!r}: cannot import {module_name!r} ({type(e).__name__}: {e})") from e
    if not hasattr(module, attr):
        raise ConfigError(f"{what} {path!r}: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


def action_class(env_cls: type) -> type | None:
    """The ``Action`` type of an ``Environment[Action, Observation, State]`` subclass, from its generic bases."""
    for klass in inspect.getmro(env_cls):
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type) and hasattr(args[0], "model_fields"):
                return args[0]
    return None


def text_field(action_cls: type) -> str | None:
    """The one field a reply's text can fill: the action's only required field, else its only non-base field."""
    fields = {n: f for n, f in action_cls.model_fields.items() if n != "metadata"}
    required = [n for n, f in fields.items() if f.is_required()]
    if len(required) == 1:
        return required[0]
    return next(iter(fields)) if len(fields) == 1 and not required else None


def observation_text(observation: Any) -> str:
    """What the model reads of an observation: its one content field as text, else its content fields as JSON."""
    if isinstance(observation, str):
        return observation
    dump = observation.model_dump() if hasattr(observation, "model_dump") else dict(observation)
    content = {k: v for k, v in dump.items() if k not in _OBS_BOOKKEEPING}
    if len(content) == 1:
        (value,) = content.values()
        if isinstance(value, str):
            return value
    return json.dumps(content, default=str, ensure_ascii=False)


class OpenEnvEpisode(Env):
    """grpokit's ``Env`` over one in-process OpenEnv environment (what ``GYMScheduler`` drives)."""

    def __init__(self, env: Any, action_cls: type, scheduler: OpenEnvScheduler, reset_kwargs: dict) -> None:
        super().__init__({})
        self.env, self.action_cls, self.scheduler, self.reset_kwargs = env, action_cls, scheduler, reset_kwargs

    async def reset(self, config: RolloutInferRequest) -> tuple[str, dict[str, Any], str]:
        reset = getattr(self.env, "reset_async", None) or self.env.reset
        obs = await _maybe_await(reset(episode_id=config.request_id, **self.reset_kwargs))
        return self.scheduler.format_observation(obs), _json_safe(getattr(obs, "metadata", None) or {}), ""

    async def step(self, action: list[dict[str, Any]]) -> tuple[str, float, bool, dict[str, Any]]:
        text = next((m.get("content") or "" for m in reversed(action) if m["role"] == "assistant"), "")
        parsed = self.scheduler.parse_action(text)
        act = (
            parsed
            if isinstance(parsed, self.action_cls)
            else self.action_cls(**self.scheduler.action_fields(parsed, self.action_cls))
        )
        step = getattr(self.env, "step_async", None) or self.env.step
        obs = await _maybe_await(step(act))
        reward = getattr(obs, "reward", None)
        return self.scheduler.format_observation(obs), float(reward or 0.0), bool(getattr(obs, "done", False)), {}

    async def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            await _maybe_await(close())


@multi_turns.register("OpenEnvScheduler")
class OpenEnvScheduler(GYMScheduler):
    """``GYMScheduler`` over an in-process OpenEnv environment (module docstring). Override ``parse_action`` (reply
    text → action fields, or an ``Action``) and ``format_observation`` (observation → the next user message)."""

    uses_env_reward = True

    def __init__(self, *args, openenv_env: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.openenv_env = openenv_env or getattr(self.rollout_args, "openenv_env", None)
        if self.openenv_env:
            import_object(self.openenv_env, "--openenv_env")  # a typo fails at start-up, not in the first window

    def parse_action(self, text: str) -> dict | Any:
        """Reply text → the action's fields (a dict) or an ``Action``. Default: a JSON object is the fields; any
        other text fills the action's one text field (``action_fields``)."""
        stripped = text.strip()
        if stripped.startswith("{"):
            try:
                value = loads(stripped, what="action")  # model-written: bounded (wire/json_text.py)
            except ValueError:
                return text
            return value if isinstance(value, dict) else text
        return text

    def action_fields(self, parsed: dict | str, action_cls: type) -> dict:
        if isinstance(parsed, dict):
            return parsed
        name = text_field(action_cls)
        if name is None:
            raise DataError(
                f"OpenEnvScheduler: {action_cls.__name__} has no single text field the reply could "
                f"fill (fields: {', '.join(action_cls.model_fields)}); the model must reply with a JSON "
                "object of its fields, or override parse_action"
            )
        return {name: parsed}

    def format_observation(self, observation: Any) -> str:
        """Observation → the next user message (default: its one text field, else its fields as JSON)."""
        return observation_text(observation)

    def _make_env(self, request: RolloutInferRequest) -> tuple[str, Env]:
        env_config = request.data_dict.get("env_config") or {}
        if not isinstance(env_config, dict):
            raise DataError(f"request {request.request_id}: env_config must be a dict, got {type(env_config).__name__}")
        if env_config.get("base_url") and not env_config.get("env"):
            raise ConfigError(
                f"OpenEnvScheduler: env_config.base_url {env_config['base_url']!r} names an OpenEnv "
                "server; grpokit runs the environment in process: give env_config.env "
                "'module:Class' (or --openenv_env module:Class) instead"
            )
        path = env_config.get("env") or self.openenv_env
        if not path:
            raise ConfigError(
                "OpenEnvScheduler: the row has no env_config.env and --openenv_env is not set; name "
                "the environment as module:Class"
            )
        factory = import_object(path, "--openenv_env" if path == self.openenv_env else "env_config.env")
        kwargs = _dict_of(env_config, "kwargs", request)
        env = factory(**kwargs)
        act_path = env_config.get("action")
        act_cls = import_object(act_path, "env_config.action") if act_path else action_class(type(env))
        if act_cls is None:
            raise ConfigError(
                f"OpenEnvScheduler: cannot tell the Action type of {type(env).__name__} (it does not "
                "subclass Environment[Action, Observation, State]); name it in env_config.action as "
                "module:Class"
            )
        return type(env).__name__, OpenEnvEpisode(env, act_cls, self, _dict_of(env_config, "reset_kwargs", request))


multi_turns["openenv_scheduler"] = OpenEnvScheduler


def _dict_of(env_config: dict, key: str, request: RolloutInferRequest) -> dict:
    value = env_config.get(key) or {}
    if not isinstance(value, dict):
        raise DataError(f"request {request.request_id}: env_config.{key} must be a dict, got {type(value).__name__}")
    return value


def _json_safe(value: dict) -> dict:
    return json.loads(json.dumps(value, default=str))


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
