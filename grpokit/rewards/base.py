"""Reward base classes and the registries that ``--reward_funcs`` names are looked up in.

The reward contract (DESIGN.md): ``reward(completions: list[str], **kwargs) -> list[float | None]``. ``kwargs``
carry the dataset's other columns by name (``solution``, ``test_cases``, …, each a list of length N) plus what
the trainer always supplies (``TRAINER_KWARGS``; ``trainer_state`` reads as ``.global_step`` and as a dict).
``None`` or NaN means "this function does not score this sample"; it is left out of the weighted sum. A function
written for TRL is called TRL's way, all by keyword (``grpokit.rewards.calling`` decides from the signature).

A plugin registers a class (instantiated once by ``build_reward_funcs``) or a ready callable under a name:
``orms["length_bonus"] = LengthBonus``, where ``LengthBonus`` subclasses ``ORM`` and defines
``__call__(self, completions, **kwargs)``; docs/plugins.md has complete examples.
"""

from __future__ import annotations

import inspect
from typing import Any

from grpokit.errors import ConfigError
from grpokit.registry import Registry
from grpokit.rewards.calling import convention

# Keys the trainer passes to every reward call, whatever the dataset holds.
TRAINER_KWARGS: frozenset[str] = frozenset(
    {
        "completions",
        "messages",
        "response_token_ids",
        "completion_ids",
        "rollout_infos",
        "finish_reason",
        "is_truncated",
        "num_turns",
        "trainer_state",
        "prompts",
        "request_id",
        "trajectory_inputs",
        "log_extra",
        "log_metric",
    }
)


class ORM:
    """A synchronous outcome reward: one score (or None) per completion.

    ``args`` is kept for code ported from ms-swift (``self.args.cosine_max_len``): ``build_reward_funcs`` passes a
    namespace of all options to a constructor that names ``args``.
    """

    def __init__(self, args: Any = None, **kwargs: Any) -> None:
        self.args = args

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(completions, **kwargs)")


class AsyncORM:
    """An asynchronous outcome reward; the runner awaits all async rewards of a batch together."""

    def __init__(self, args: Any = None, **kwargs: Any) -> None:
        self.args = args

    async def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        raise NotImplementedError(f"{type(self).__name__} must implement async __call__(completions, **kwargs)")


class PRM(ORM):
    """A process reward: scores each reasoning step, then folds the step scores into one reward.

    Subclasses implement ``score_steps``; ``aggregate`` picks how step scores become the reward
    (``mean``: fraction of good steps when scores are 0/1, ``min``: the weakest step, ``last``: the final step).
    A completion without steps gets None (not scored).
    """

    aggregations: tuple[str, ...] = ("mean", "min", "last")

    def __init__(self, args: Any = None, aggregate: str = "mean", **kwargs: Any) -> None:
        super().__init__(args)
        if aggregate not in self.aggregations:
            raise ConfigError(f"PRM aggregate={aggregate!r}: unknown; use one of {', '.join(self.aggregations)}")
        self.aggregate = aggregate

    def score_steps(self, completion: str, **row: Any) -> list[float]:
        """Scores of the completion's steps, in order ([] when it has none)."""
        raise NotImplementedError(f"{type(self).__name__} must implement score_steps(completion, **row)")

    def __call__(self, completions: list[str], **kwargs: Any) -> list[float | None]:
        n = len(completions)
        per_sample = {k: v for k, v in kwargs.items() if isinstance(v, (list, tuple)) and len(v) == n}
        out: list[float | None] = []
        for i, completion in enumerate(completions):
            steps = self.score_steps(completion, **{k: v[i] for k, v in per_sample.items()})
            if not steps:
                out.append(None)
            elif self.aggregate == "mean":
                out.append(sum(steps) / len(steps))
            elif self.aggregate == "min":
                out.append(min(steps))
            else:
                out.append(steps[-1])
        return out


orms: Registry = Registry("reward function", "--reward_funcs")
prms: Registry = Registry("process reward model", "--reward_funcs")


def _call_params(func: Any) -> list[inspect.Parameter]:
    """Parameters of a reward call: a function's, or the ``__call__`` of a class (without ``self``) or instance."""
    try:
        if inspect.isclass(func):
            return list(inspect.signature(func.__call__).parameters.values())[1:]
        return list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # no introspectable signature (some builtins): assume (completions, **kwargs)
        return [
            inspect.Parameter("completions", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
        ]


def _after_completions(params: list[inspect.Parameter], func: Any = None) -> list[inspect.Parameter]:
    """Drop the first positional parameter: the runner passes completions there, whatever its name (ms-swift's
    convention; a function called TRL's way gets every parameter by keyword, so none is dropped)."""
    if func is not None and convention(func) == "trl":
        return params
    for i, p in enumerate(params):
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return params[:i] + params[i + 1 :]
        if p.kind == p.VAR_POSITIONAL:
            break
    return params


def required_columns(func: Any) -> set[str]:
    """Keyword parameters of the reward call without a default, except the one that receives completions."""
    return {
        p.name
        for p in _after_completions(_call_params(func), func)
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name != "completions"
    }


def accepted_kwargs(func: Any) -> set[str] | None:
    """Names the reward call accepts by keyword, or None when it takes ``**kwargs`` (then it gets everything)."""
    params = _after_completions(_call_params(func), func)
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
