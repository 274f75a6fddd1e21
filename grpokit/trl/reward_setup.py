"""TRL's ``reward_funcs`` into grpokit's (name, callable) rewards, in TRL's order and under TRL's names.

Each entry, as TRL reads it: a function (sync or async, or a callable object) is called TRL's way, whatever its
signature (``prompts``, ``completions`` as message lists on conversational rows, ``completion_ids``, the dataset's
columns, ``trainer_state``, ``log_extra``/``log_metric``; ``None`` per sample means not scored); a string is a reward
model's folder (a sequence classifier with one label, loaded frozen); a ``PreTrainedModel`` is a reward model as
given, with its tokenizer from ``reward_processing_classes`` or its folder. Names: a function's ``__name__``, a
model's folder name (TRL's ``rewards/<name>/mean`` columns).
"""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path
from typing import Any

from grpokit.errors import ConfigError
from grpokit.rewards import DefaultRMPlugin, RewardModelReward, RMTemplate, make_rm_plugin, orms, trl_convention
from grpokit.rewards.calling import is_marked


def reward_list(reward_funcs: Any, reward_processing_classes: Any, torch_dtype: str) -> list[tuple[str, Any]]:
    """(name, callable) per entry of TRL's ``reward_funcs``; an unusable entry stops with one line."""
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    funcs = [f for f in funcs if f is not None]
    tokenizers = _per_reward(reward_processing_classes, len(funcs))
    return [_one(i, f, tokenizers[i], torch_dtype) for i, f in enumerate(funcs)]


def _per_reward(classes: Any, n: int) -> list:
    if classes is None:
        return [None] * n
    if not isinstance(classes, (list, tuple)):
        if n != 1:
            raise ConfigError(
                f"GRPOTrainer(reward_processing_classes=...): one tokenizer for {n} rewards; give a "
                "list with one entry per reward function (None for a function)"
            )
        return [classes]
    if len(classes) != n:
        raise ConfigError(
            f"GRPOTrainer(reward_processing_classes=...): {len(classes)} entries for {n} rewards; give "
            "one per reward function (None where none is needed)"
        )
    return list(classes)


def _one(i: int, func: Any, tokenizer: Any, torch_dtype: str) -> tuple[str, Any]:
    if isinstance(func, (str, os.PathLike)):
        path = str(func)
        if not Path(path).expanduser().exists() and path in orms:  # grpokit's registered rewards, by name
            return path, orms[path]
        plugin = make_rm_plugin(DefaultRMPlugin, path, torch_dtype)
        return _rm(Path(path).name or path, plugin)
    if _is_model(func):
        if tokenizer is None:
            tokenizer = _model_tokenizer(func, i)
        func.requires_grad_(False).eval()
        return _rm(_model_name(func), DefaultRMPlugin(func, RMTemplate(tokenizer)))
    if not callable(func):
        raise ConfigError(
            f"GRPOTrainer(reward_funcs[{i}]=<{type(func).__name__}>): give a function, a reward "
            "model's folder or a PreTrainedModel"
        )
    name = getattr(func, "__name__", None) or type(func).__name__
    return name, _trl_called(func)


def _rm(name: str, plugin: Any) -> tuple[str, Any]:
    return name, RewardModelReward(plugin, name)


def _trl_called(func: Any) -> Any:
    """``func`` marked to be called TRL's way; a callable that cannot carry the mark gets a thin wrapper."""
    if is_marked(func):
        return func
    try:
        return trl_convention(func)
    except ConfigError:
        pass
    if inspect.iscoroutinefunction(getattr(func, "__call__", func)):

        @functools.wraps(func)
        async def wrapped(*args, **kwargs):
            return await func(*args, **kwargs)
    else:

        @functools.wraps(func)
        def wrapped(*args, **kwargs):
            return func(*args, **kwargs)

    return trl_convention(wrapped)


def _is_model(obj: Any) -> bool:
    return hasattr(obj, "config") and callable(getattr(obj, "forward", None)) and hasattr(obj, "requires_grad_")


def _model_name(model: Any) -> str:
    path = getattr(model.config, "_name_or_path", "") or type(model).__name__
    return path.rstrip("/").split("/")[-1]


def _model_tokenizer(model: Any, i: int) -> Any:
    from transformers import AutoTokenizer  # not at the top: only for a reward model given as an object

    path = getattr(model.config, "_name_or_path", "")
    if not path:
        raise ConfigError(
            f"GRPOTrainer(reward_funcs[{i}]=<{type(model).__name__}>): the model names no folder to "
            "load its tokenizer from; give it in reward_processing_classes"
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return tokenizer
