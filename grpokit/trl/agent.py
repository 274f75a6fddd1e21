"""TRL's ``tools``, ``environment_factory`` and ``rollout_func`` on grpokit's rollout machinery.

- ``tools``: plain functions (sync or async, type hints and a Google-style docstring, as TRL requires); their JSON
  schemas go into every prompt through the chat template's ``tools=``, and ``TrlToolScheduler`` (a
  ``MultiTurnScheduler``: token in, token out; tool results are template tokens with loss mask 0) plays TRL's loop:
  the model's ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks are run, each result (or
  ``{"error": ...}``) comes back as a ``tool`` message, and the model goes on, until a reply calls no tool or
  ``max_tool_calling_iterations`` rounds were played. The whole trajectory is bounded by max_completion_length.
- ``environment_factory``: one instance per trajectory; ``reset(**row)`` may return text appended to the last
  prompt message; its public methods are tools; a ``get_reward()`` method is one more reward, named after the
  class; rewards may take ``environments`` (the trajectories' instances). A dict of factories picks one per row by
  the row's ``environment`` column.
- ``rollout_func(prompts, trainer)``: ``RolloutFuncScheduler`` calls it with each prompt once; it returns
  ``prompt_ids``, ``completion_ids`` and ``logprobs`` (num_generations per prompt, in order) and any other fields,
  which reach the rewards by name; ``env_mask`` (1 = model token) is the loss mask.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from collections import OrderedDict
from typing import Any

from grpokit.data import CONVERSATIONAL_COLUMN
from grpokit.errors import ConfigError, RolloutError
from grpokit.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, RolloutOutput
from grpokit.rewards import trl_convention
from grpokit.rollout.multi_turn import MultiTurnScheduler
from grpokit.rollout.scheduler import RolloutScheduler, _tag
from grpokit.trl.tool_calls import call_tool, parse_tool_calls, tool_methods, tool_schemas

_KEEP_ENVIRONMENTS = 8192  # trajectories whose environment a reward may still ask for
_ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs")
TRL_FIELDS = "trl_fields"  # rollout_infos key of rollout_func's extra fields


class TrlToolScheduler(MultiTurnScheduler):
    """TRL's tool-calling loop (module docstring). ``tools``: the standalone tools; ``factories``: {name or None:
    environment factory}; ``max_iterations``: tool rounds (None: until a reply calls no tool)."""

    def __init__(
        self, infer_engine=None, *, tools: list, factories: dict | None, max_iterations: int | None, **kwargs
    ) -> None:
        turns = max_iterations + 1 if max_iterations is not None else 1 << 30
        super().__init__(infer_engine, max_turns=turns, completion_length_limit_scope="total", **kwargs)
        self.tools, self.factories = list(tools), factories
        self.environments: OrderedDict[str, Any] = OrderedDict()  # request id -> its trajectory's environment
        self._pending: dict[str, list[tuple[str, Any]]] = {}  # request id -> this turn's tool results

    async def on_trajectory_start(self, requests) -> None:
        for request in requests:
            if self.factories is None:
                continue
            row = {k: v for k, v in request.data_dict.items() if k != CONVERSATIONAL_COLUMN}
            multi = list(self.factories) != [None]
            env = self.factories[row.pop("environment", None) if multi else None]()
            try:
                observation = env.reset(**{"prompt": request.messages, **row})
                if inspect.isawaitable(observation):
                    observation = await observation
            except Exception as e:  # the user's environment: name it, one line
                raise RolloutError(f"environment {type(env).__name__}.reset() raised {type(e).__name__}: {e}") from e
            if observation is not None:
                last = request.messages[-1]
                request.messages[-1] = {**last, "content": (last.get("content") or "") + str(observation)}
            self.environments[request.request_id] = env
            while len(self.environments) > _KEEP_ENVIRONMENTS:
                self.environments.popitem(last=False)

    def _tools_of(self, request_id: str) -> dict:
        env = self.environments.get(request_id)
        return {t.__name__: t for t in self.tools + (tool_methods(env) if env is not None else [])}

    async def on_turn_end(self, infer_request, response_choice, current_turn: int) -> dict:
        calls = parse_tool_calls(response_choice.message.get("content") or "")
        if calls is None:
            return {"done": True}
        if current_turn >= self.max_turns:  # the last round allowed: its calls are not run (as in TRL)
            return {"done": True}
        tools = self._tools_of(infer_request.request_id)
        results = [await call_tool(tools, call) for call in calls]
        self._pending[infer_request.request_id] = [(name, result) for name, result, _ in results]
        failures = sum(failed for _, _, failed in results)
        return {"rollout_infos": {"tool_calls": len(calls), "tool_failures": failures}}

    def step(self, infer_request, response_choice, current_turn: int) -> dict:
        for name, result in self._pending.pop(infer_request.request_id, []):
            content = result if isinstance(result, list) else str(result)
            infer_request.messages.append({"role": "tool", "name": name, "content": content})
        return {"infer_request": infer_request}

    async def on_trajectory_end(self, infer_request) -> None:
        self._pending.pop(infer_request.request_id, None)

    def environment_reward(self, env_type: type):
        """TRL's reward column of an environment class that defines get_reward (None for other classes' rows)."""

        async def reward(request_id: list[str], **kwargs) -> list[float | None]:
            out = []
            for rid in request_id:
                env = self.environments.get(rid)
                value = env.get_reward() if type(env) is env_type else None
                out.append(await value if inspect.isawaitable(value) else value)
            return out

        reward.__name__ = env_type.__name__
        return trl_convention(reward)


def _parameters(func: Any) -> set[str]:
    try:
        return set(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return set()


def _takes_var_keyword(func: Any) -> bool:
    try:
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return False


def _with_request_id(func: Any) -> inspect.Signature:
    """``func``'s signature without ``environments`` and with ``request_id`` (the runner passes what it names)."""
    sig = inspect.signature(func)
    params = [p for p in sig.parameters.values() if p.name != "environments"]
    extra = inspect.Parameter("request_id", inspect.Parameter.KEYWORD_ONLY)
    var = [p for p in params if p.kind is p.VAR_KEYWORD]
    rest = [p for p in params if p.kind is not p.VAR_KEYWORD]
    return sig.replace(parameters=[*rest, extra, *var])


class RolloutFuncScheduler(RolloutScheduler):
    """TRL's ``rollout_func(prompts, trainer)`` in place of the engine: one call per batch, each prompt once."""

    def __init__(self, infer_engine=None, *, rollout_func: Any, owner: Any, num_generations: int, **kwargs) -> None:
        super().__init__(infer_engine, **kwargs)
        self.rollout_func, self.owner, self.num_generations = rollout_func, owner, num_generations

    async def async_infer(self, requests, request_config) -> list[RolloutOutput]:
        groups: OrderedDict[str, list] = OrderedDict()
        for request in requests:
            groups.setdefault(request.prompt_id, []).append(request)
        firsts = [group[0] for group in groups.values()]
        prompts = [
            r.messages if r.data_dict.get(CONVERSATIONAL_COLUMN, True) else r.messages[-1]["content"] for r in firsts
        ]
        if getattr(self.owner, "processing_class", None) is None:
            self.owner.processing_class = self.tokenizer  # what a rollout_func tokenizes with
        try:
            out = await asyncio.to_thread(self.rollout_func, prompts, self.owner)
        except Exception as e:  # the user's function: name it, one line
            name = getattr(self.rollout_func, "__name__", "rollout_func")
            raise RolloutError(f"rollout_func {name}() raised {type(e).__name__}: {e}") from e
        fields = self._checked(out, len(prompts) * self.num_generations)
        outputs = []
        for k, group in enumerate(groups.values()):
            for j, request in enumerate(group):
                i = k * self.num_generations + j
                outputs += _tag([self._output(request, fields, i)], request)
        return outputs

    def _checked(self, out: Any, n: int) -> dict:
        if not isinstance(out, dict) or any(key not in out for key in _ROLLOUT_KEYS):
            missing = [key for key in _ROLLOUT_KEYS if not isinstance(out, dict) or key not in out]
            raise RolloutError(
                f"rollout_func must return a dict with {', '.join(_ROLLOUT_KEYS)}; missing {', '.join(missing)}"
            )
        for key, values in out.items():
            if not isinstance(values, (list, tuple)) or len(values) != n:
                got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
                raise RolloutError(
                    f"rollout_func returned {key} with {got} entries; it must return one per "
                    f"completion: {n} (num_generations={self.num_generations} per prompt)"
                )
        return out

    def _output(self, request, fields: dict, i: int) -> RolloutOutput:
        ids = [int(t) for t in fields["completion_ids"][i]]
        lps = [float(x) for x in (fields["logprobs"][i] or [])]
        mask = [int(m) for m in fields.get("env_mask", [None] * (i + 1))[i] or [1] * len(ids)]
        if len(mask) != len(ids) or (lps and len(lps) != len(ids)):
            raise RolloutError(
                f"rollout_func: completion {i} has {len(ids)} completion_ids, {len(lps)} logprobs "
                f"and {len(mask)} env_mask entries; give one each per token"
            )
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        choice = ChatCompletionResponseChoice(
            message={"role": "assistant", "content": text}, token_ids=ids, finish_reason="stop"
        )
        extra = {k: v[i] for k, v in fields.items() if k not in (*_ROLLOUT_KEYS, "env_mask", "logprob_token_ids")}
        kept = [lp for lp, m in zip(lps, mask, strict=True) if m] if lps else []
        return RolloutOutput(
            response=ChatCompletionResponse(choices=[choice], prompt_token_ids=list(fields["prompt_ids"][i])),
            messages=[*request.messages, {"role": "assistant", "content": text}],
            response_token_ids=[ids],
            response_loss_mask=[mask],
            rollout_infos={"num_turns": 1, TRL_FIELDS: extra},
            rollout_logprobs=[kept] if kept else [],
        )


def with_rollout_fields(func: Any) -> Any:
    """``func`` given rollout_func's extra fields by name, as TRL forwards them."""

    def fields(kwargs: dict) -> dict:
        infos = kwargs.get("rollout_infos") or []
        names = {k for info in infos for k in (info or {}).get(TRL_FIELDS, {})}
        return {name: [(info or {}).get(TRL_FIELDS, {}).get(name) for info in infos] for name in names}

    if inspect.iscoroutinefunction(getattr(func, "__call__", func)):

        @functools.wraps(func)
        async def wrapped(*args, **kwargs):
            return await func(*args, **{**kwargs, **fields(kwargs)})
    else:

        @functools.wraps(func)
        def wrapped(*args, **kwargs):
            return func(*args, **{**kwargs, **fields(kwargs)})

    # every argument is passed: the fields are not dataset columns, which the start-up check would look for
    wrapped.__signature__ = inspect.Signature([inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)])
    return trl_convention(wrapped)


def rollout_parts(cfg, tools, environment_factory, rollout_func, args, owner, rewards):
    """(scheduler or recipe or None, rewards, tool schemas per row or None) for TRL's rollout arguments."""
    if rollout_func is not None:
        if tools or environment_factory:
            raise ConfigError(
                "GRPOTrainer(rollout_func=...): give it alone; rollout_func plays the rollout, so "
                "tools and environment_factory would not be called"
            )
        scheduler = functools.partial(
            _rollout_scheduler, rollout_func=rollout_func, owner=owner, num_generations=cfg.rollout.num_generations
        )
        return scheduler, [(n, with_rollout_fields(f)) for n, f in rewards], None
    if not tools and environment_factory is None:
        return None, rewards, None
    factories = (
        dict(environment_factory)
        if isinstance(environment_factory, dict)
        else None
        if environment_factory is None
        else {None: environment_factory}
    )
    probes = {name: factory() for name, factory in (factories or {}).items()}
    for name, env in probes.items():
        if not callable(getattr(env, "reset", None)):
            raise ConfigError(
                f"GRPOTrainer(environment_factory=...): the environment {type(env).__name__} has no "
                "reset method; TRL's environments define reset(**row)"
            )
    schemas = {name: tool_schemas(list(tools or []) + tool_methods(env)) for name, env in probes.items()}
    if not probes:
        schemas = {None: tool_schemas(list(tools or []))}
    holder: dict = {}

    def recipe(engine):
        holder["scheduler"] = TrlToolScheduler(
            engine,
            tools=list(tools or []),
            factories=factories,
            max_iterations=args.max_tool_calling_iterations,
            rollout_args=cfg.rollout,
        )
        return holder["scheduler"]

    rewards = [(n, _deferred_environments(f, holder)) if factories else (n, f) for n, f in rewards]
    seen: list[type] = []
    for env in probes.values():
        if callable(getattr(env, "get_reward", None)) and type(env) not in seen:
            seen.append(type(env))
            rewards.append((type(env).__name__, _deferred_env_reward(type(env), holder)))
    return recipe, rewards, schemas


def _rollout_scheduler(engine, **kwargs):
    return RolloutFuncScheduler(engine, **kwargs)


def _deferred_environments(func: Any, holder: dict) -> Any:
    """``func`` with ``environments``, from the scheduler the trainer builds (rewards run after it exists)."""
    if "environments" not in _parameters(func) and not _takes_var_keyword(func):
        return func
    is_async = inspect.iscoroutinefunction(getattr(func, "__call__", func))

    def envs(request_id):
        return [holder["scheduler"].environments.get(r) for r in request_id]

    if is_async:

        @functools.wraps(func)
        async def wrapped(*args, request_id, **kwargs):
            return await func(*args, environments=envs(request_id), **kwargs)
    else:

        @functools.wraps(func)
        def wrapped(*args, request_id, **kwargs):
            return func(*args, environments=envs(request_id), **kwargs)

    wrapped.__signature__ = _with_request_id(func)
    return trl_convention(wrapped)


def _deferred_env_reward(env_type: type, holder: dict) -> Any:
    async def reward(request_id: list[str], **kwargs) -> list[float | None]:
        return await holder["scheduler"].environment_reward(env_type)(request_id=request_id)

    reward.__name__ = env_type.__name__
    return trl_convention(reward)


def with_tools(dataset: Any, schemas: dict, where: str) -> Any:
    """``dataset`` with a ``tools`` column: each row's tool schemas (by its ``environment`` with several)."""
    if "tools" in dataset.column_names:
        raise ConfigError(
            f"GRPOTrainer({where}=...): the dataset has a tools column and tools= (or "
            "environment_factory) is given; give the tools one way"
        )
    multi = list(schemas) != [None]
    if multi and "environment" not in dataset.column_names:
        raise ConfigError(
            f"GRPOTrainer({where}=...): environment_factory is a dict, so each row needs an "
            f"environment column naming one of {sorted(schemas)}"
        )
    names = dataset["environment"] if multi else [None] * len(dataset)
    unknown = sorted({str(n) for n in names if n not in schemas})
    if unknown:
        raise ConfigError(
            f"GRPOTrainer({where}=...): rows name environment {unknown[0]!r}, which is not among the "
            f"environment_factory keys {sorted(schemas)}"
        )
    return dataset.add_column("tools", [json.dumps(schemas[n]) for n in names])
