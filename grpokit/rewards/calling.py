"""How a reward function is called: ms-swift's convention or TRL's, chosen per function from its signature.

- **ms-swift / grpokit** (``ORM`` classes and functions such as ``f(completions, solution, **kwargs)``): the
  completion texts go in the first positional parameter, everything else by keyword (dataset columns,
  ``messages``, ``trainer_state``, ``request_id``, ``trajectory_inputs``, ...).
- **TRL** (functions that name ``prompts``, ``log_extra`` or ``log_metric``, whose first parameter is
  ``prompts``/``completion_ids``/``trainer_state``, that take keywords only, or that are marked with
  ``trl_convention``): everything by keyword. ``prompts`` and ``completions`` come in the format TRL picks from
  the dataset: conversational (message lists) for a row whose prompt came as messages, standard (strings: the
  prompt's last user message and the completion text) for a row whose prompt came as a string. The loader
  records which in the hidden column ``CONVERSATIONAL_COLUMN``; ``trl_convention(f, conversational=...)``
  overrides it for one function.

A signature that fits neither (no parameter at all, positional-only parameters the call cannot fill) is refused
before training by ``check_signature``. ``log_extra(column, values)`` and ``log_metric(name, value)`` (TRL's
names and meaning) are passed to every function that accepts them; what they record lands in a ``RewardLog``.

What a reward returns, read by ``check_scores``: N scores, as a list, tuple, 1-D array or 1-D tensor of exactly N
finite numbers or None (NaN), within float32's range; anything else is a one-line ``RewardError`` naming the reward
(a ``[2, N/2]`` tensor is refused, never flattened).
"""

from __future__ import annotations

import inspect
import math
import numbers
import sys
import threading
from typing import TYPE_CHECKING, Any, Literal

from grpokit.data import CONVERSATIONAL_COLUMN
from grpokit.errors import ConfigError, RewardError

if TYPE_CHECKING:
    import torch

Convention = Literal["swift", "trl"]
_MARK = "__grpokit_reward_convention__"
TRL_ONLY = frozenset({"prompts", "log_extra", "log_metric"})
_TRL_FIRST = frozenset({"prompts", "completion_ids", "trainer_state"})


class TrainerStateView:
    """The trainer state a reward sees: attributes as in ms-swift/TRL (``trainer_state.global_step``) and, for
    existing grpokit rewards, dict access (``trainer_state["global_step"]``, ``.get``)."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def __getitem__(self, key: str) -> Any:
        return self.__dict__[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.__dict__.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.__dict__

    def keys(self) -> list[str]:
        return list(self.__dict__)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TrainerStateView):
            other = other.__dict__
        return isinstance(other, dict) and self.__dict__ == other

    __hash__ = None

    def __repr__(self) -> str:
        return f"TrainerStateView({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


def as_trainer_state(value: Any) -> Any:
    """A dict becomes a ``TrainerStateView``; anything else is passed as it is."""
    return TrainerStateView(**value) if isinstance(value, dict) else value


def trl_convention(func: Any, *, conversational: bool | None = None) -> Any:
    """Mark a reward function to be called TRL's way (for one whose signature alone does not say so, such as
    ``f(completions, **kwargs)``, which ms-swift's rewards share). ``conversational`` fixes the format of
    ``prompts``/``completions`` for this function (True: message lists, False: strings); None (the default)
    lets each row's dataset format decide, as TRL does. Returns the function itself."""
    mark = {None: "trl", True: "trl-conversational", False: "trl-standard"}.get(conversational)
    if mark is None:
        raise ConfigError(f"trl_convention: conversational must be True, False or None, got {conversational!r}")
    try:
        setattr(func, _MARK, mark)
    except (AttributeError, TypeError):
        raise ConfigError(f"trl_convention: cannot mark {func!r}; wrap it in a plain def") from None
    return func


def is_marked(func: Any) -> bool:
    """True when ``trl_convention`` marked ``func``."""
    return getattr(func, _MARK, None) is not None


def is_conversational(func: Any) -> bool | None:
    """The format ``func`` was marked to read: True (message lists), False (strings), None (not marked: the
    dataset decides)."""
    return {"trl-conversational": True, "trl-standard": False}.get(getattr(func, _MARK, None))


def _params(func: Any) -> list[inspect.Parameter] | None:
    try:
        if inspect.isclass(func):
            return list(inspect.signature(func.__call__).parameters.values())[1:]
        return list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None  # not introspectable: assume (completions, **kwargs)


def convention(func: Any) -> Convention:
    """Which convention calls ``func`` (see the module docstring)."""
    if is_marked(func):
        return "trl"
    params = _params(func)
    if params is None:
        return "swift"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if TRL_ONLY & {p.name for p in params} or (positional and positional[0].name in _TRL_FIRST):
        return "trl"
    if positional or any(p.kind == p.VAR_POSITIONAL for p in params):
        return "swift"
    return "trl"  # keywords only (``def f(*, completions, **kw)``, ``def f(**kw)``): TRL calls by keyword


def check_signature(func: Any, name: str) -> Convention:
    """The convention of ``func``; ConfigError naming the reward when its signature fits neither."""
    params = _params(func)
    if params is None:
        return "swift"
    conv = convention(func)
    if not params:
        raise ConfigError(
            f"--reward_funcs {name}: {_describe(func)} takes no arguments; a reward takes the "
            "completions (ms-swift: f(completions, **kwargs)) or keywords (TRL: f(prompts, "
            "completions, **kwargs))"
        )
    pos_only = [p.name for p in params if p.kind == p.POSITIONAL_ONLY]
    if conv == "trl" and pos_only:
        raise ConfigError(
            f"--reward_funcs {name}: {_describe(func)} is called with keywords (TRL convention), but "
            f"{', '.join(pos_only)} is positional-only; drop the '/' from its signature"
        )
    if conv == "swift" and len(pos_only) > 1:
        raise ConfigError(
            f"--reward_funcs {name}: {_describe(func)} has positional-only parameters "
            f"{', '.join(pos_only[1:])} after the completions; only the completions are passed "
            "positionally, make the others keyword parameters"
        )
    return conv


def _describe(func: Any) -> str:
    return getattr(func, "__qualname__", None) or type(func).__name__


def trl_kwargs(completions: list[str], kwargs: dict[str, Any], conversational: bool | None) -> dict[str, Any]:
    """TRL's keyword arguments next to everything else the trainer supplies, each sample in its row's format
    (``kwargs[CONVERSATIONAL_COLUMN]``; standard where absent) unless ``conversational`` fixes one. Standard:
    ``prompts`` the text of each prompt's last user message, ``completions`` the texts. Conversational:
    ``prompts`` the prompt messages, ``completions`` the messages after the prompt (one assistant message for a
    single turn). TRL continues a prompt that ends with an assistant message; here none does (the loader takes
    a trailing assistant message as the row's reference reply)."""
    out = swift_kwargs(kwargs)
    flags = kwargs.get(CONVERSATIONAL_COLUMN) if conversational is None else None
    formats = [bool(flags[i]) if flags is not None else bool(conversational) for i in range(len(completions))]
    prompts, conversations = kwargs.get("prompts"), kwargs.get("messages")
    if prompts is not None:
        out["prompts"] = [p if conv else _last_user_text(p) for p, conv in zip(prompts, formats, strict=True)]
    out["completions"] = [
        _completion_messages(i, text, prompts, conversations) if conv else text
        for i, (text, conv) in enumerate(zip(completions, formats, strict=True))
    ]
    return out


def swift_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without the hidden dataset-format column (no reward sees it as a column)."""
    return {k: v for k, v in kwargs.items() if k != CONVERSATIONAL_COLUMN}


def _completion_messages(i: int, text: str, prompts: list | None, conversations: list | None) -> list[dict]:
    prompt = prompts[i] if prompts is not None else None
    full = conversations[i] if conversations is not None else None
    if prompt is not None and full is not None and len(full) > len(prompt):
        return [dict(m) for m in full[len(prompt) :]]
    return [{"role": "assistant", "content": text}]


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    return str(users[-1]) if users and users[-1] is not None else ""


class RewardLog:
    """What reward functions recorded through ``log_extra``/``log_metric`` in one scoring call of N samples."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.extra: dict[str, list[Any]] = {}
        self.metrics: dict[str, list[float]] = {}

    def hooks(self, reward: str) -> dict[str, Any]:
        """``log_extra`` and ``log_metric`` for the reward named ``reward``: they check what they are given."""

        def log_extra(column: str, values: list[Any]) -> None:
            if not isinstance(column, str) or not column:
                raise RewardError(f"reward {reward!r}: log_extra column must be a non-empty string, got {column!r}")
            values = list(values) if isinstance(values, (list, tuple)) else values
            if not isinstance(values, list) or len(values) != self.n:
                got = f"{len(values)} values" if isinstance(values, list) else type(values).__name__
                raise RewardError(
                    f"reward {reward!r}: log_extra({column!r}, values) needs one value per completion "
                    f"({self.n}), got {got}"
                )
            self.extra[column] = values

        def log_metric(name: str, value: float) -> None:
            if not isinstance(name, str) or not name:
                raise RewardError(f"reward {reward!r}: log_metric name must be a non-empty string, got {name!r}")
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                raise RewardError(
                    f"reward {reward!r}: log_metric({name!r}, value) needs a finite number, got {value!r}"
                )
            self.metrics.setdefault(name, []).append(float(value))

        return {"log_extra": log_extra, "log_metric": log_metric}


class RewardLogBook:
    """RewardLogs by request id, from scoring until the window that trains on those samples is built (the next
    window's rollout may be scored meanwhile, with --async_generate)."""

    def __init__(self) -> None:
        self._seq = 0
        # (request_id, its k-th output: a custom run() may return several) -> (call seq, row, log)
        self._by_id: dict[tuple[str, int], tuple[int, int, RewardLog]] = {}
        self._lock = threading.Lock()  # the rollout thread adds while the loop's thread takes

    def add(self, request_ids: list[str], log: RewardLog) -> None:
        with self._lock:
            self._seq += 1
            for row, key in enumerate(_keys(request_ids)):
                self._by_id[key] = (self._seq, row, log)

    def take(self, request_ids: list[str]) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """Per request: its extra columns; and the mean of each metric over the calls that scored them. Entries
        older than the oldest call taken are dropped (samples dynamic sampling discarded)."""
        with self._lock:
            found = [self._by_id.pop(key, None) for key in _keys(request_ids)]
            calls = {id(e[2]): e for e in found if e is not None}
            if calls:
                oldest = min(e[0] for e in calls.values())
                self._by_id = {k: e for k, e in self._by_id.items() if e[0] >= oldest}
        extras = [{c: v[e[1]] for c, v in e[2].extra.items()} if e else {} for e in found]
        sums: dict[str, list[float]] = {}
        for _, _, log in calls.values():
            for name, values in log.metrics.items():
                sums.setdefault(name, []).extend(values)
        return extras, {name: sum(v) / len(v) for name, v in sums.items()}


def _keys(request_ids: list[str]) -> list[tuple[str, int]]:
    seen: dict[str, int] = {}
    keys = []
    for rid in request_ids:
        keys.append((rid, seen.get(rid, 0)))
        seen[rid] = seen.get(rid, 0) + 1
    return keys


_PREVIEW = 60
_FLOAT32_MAX = 3.4028234663852886e38
_BAD = object()


def preview(text: Any) -> str:
    s = repr(text)
    return s if len(s) <= _PREVIEW else s[: _PREVIEW - 3] + "..."


def check_scores(name: str, out: Any, completions: list[str]) -> torch.Tensor:
    """``out`` of the reward ``name`` as a float32 tensor [N] (NaN = not scored); RewardError otherwise."""
    import torch

    n = len(completions)
    if not isinstance(out, (list, tuple)) and hasattr(out, "tolist") and hasattr(out, "shape"):
        shape = tuple(out.shape)
        if len(shape) != 1:  # a [2, N/2] tensor is not N scores, whatever its size
            raise RewardError(
                f"reward {name!r} returned a {type(out).__name__} of shape {list(shape)}; need a list or a 1-D "
                f"array/tensor of {n} scores (one per completion)"
            )
        out = out.detach().float().cpu().tolist() if isinstance(out, torch.Tensor) else out.tolist()
    if not isinstance(out, (list, tuple)):
        raise RewardError(
            f"reward {name!r} returned {type(out).__name__}, not a list of {n} scores (one per completion)"
        )
    if len(out) != n:
        first = min(len(out), n)
        where = f"first sample without a score: {first} {preview(completions[first])}" if n > first else ""
        raise RewardError(
            f"reward {name!r} returned {len(out)} scores for {n} completions; {where or 'too many scores'}"
        )
    values = []
    for j, v in enumerate(out):
        f = _as_score(v)
        if f is _BAD or abs(f) > _FLOAT32_MAX:  # 1e39 is a float, and inf in float32 (the scores' dtype)
            beyond = " (beyond float32's range, ±3.4e38, the training dtype of scores)" if f is not _BAD else ""
            raise RewardError(
                f"reward {name!r}: sample {j} got score {preview(v)}{beyond} (need a finite number or None); "
                f"completion {preview(completions[j])}"
            )
        values.append(f)
    return torch.tensor(values, dtype=torch.float32)


def _as_score(v: Any) -> Any:
    """float(v), NaN for None/NaN, or _BAD for anything else (strings, inf, containers)."""
    if v is None:
        return math.nan
    torch = sys.modules.get("torch")  # a tensor can only come from an imported torch
    if torch is not None and isinstance(v, torch.Tensor) and v.numel() == 1:
        v = v.item()
    elif hasattr(v, "item") and getattr(v, "shape", None) == ():
        v = v.item()  # numpy scalar
    if not isinstance(v, numbers.Real):  # bool is an int, so True/False pass as 1.0/0.0
        return _BAD
    f = float(v)
    return _BAD if math.isinf(f) else f
