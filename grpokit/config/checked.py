"""One gate for every configuration, whoever built it (flags, YAML, the TRL API, code): each value against its
field, the derived defaults filled, the rules between options. ``grpokit train``'s parser passes through it, and so
does the pipeline's assembly: a ``TrainConfig`` built in code gets the same one-line errors as the command line.

A configuration that passed remembers it (a stamp of its values): the assembly's second pass over a parsed
configuration costs nothing and prints no warning twice; a configuration changed after its check is checked again.
"""

from __future__ import annotations

from grpokit.config.args import TrainConfig
from grpokit.config.fields import check_fields
from grpokit.config.resolve import resolve
from grpokit.config.validate import validate

_STAMP = "_grpokit_checked"


def checked_config(cfg: TrainConfig, supplied_rewards: int = 0, supplied_eval: bool = False) -> TrainConfig:
    """``cfg`` checked and resolved (a copy; ``cfg`` is not changed). A caller's parts: ``supplied_rewards`` reward
    callables besides ``--reward_funcs`` (``--reward_weights`` counts them), ``supplied_eval`` evaluation rows."""
    stamp = _stamp(cfg, supplied_rewards, supplied_eval)
    if cfg.__dict__.get(_STAMP) == stamp:
        return cfg
    check_fields(cfg)  # before resolve: an error names the option as given (--max_new_tokens, not its target)
    out = resolve(cfg)
    validate(out, supplied_rewards, supplied_eval)
    out.__dict__[_STAMP] = _stamp(out, supplied_rewards, supplied_eval)
    return out


def _stamp(cfg: TrainConfig, supplied_rewards: int, supplied_eval: bool) -> str:
    return f"{supplied_rewards}:{supplied_eval}:{cfg!r}"
