"""The length options against a local model folder's context, read from its config.json before anything loads.

A folder's ``max_position_embeddings`` (or ``n_positions``, ...; a vision-language model's ``text_config``) bounds
``--max_completion_length``, and ``--max_length`` + ``--max_completion_length`` when prompts are bounded too. A
RoPE scaling factor widens the bound, so it errs high and never refuses a length the model can take. The demo
model and hub ids are not read here (no folder yet); the loaded model's own checks cover them.
"""

from __future__ import annotations

import json
from pathlib import Path

from grpokit.config.args import TrainConfig
from grpokit.errors import ConfigError


def model_context(folder: str | Path) -> tuple[int, str] | None:
    """The positions a local model folder's config.json allows (with a RoPE scaling factor applied, so the bound
    errs high), and the key it came from; None when the folder or the key is missing."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for part in (config, config.get("text_config"), config.get("llm_config")):
        if not isinstance(part, dict):
            continue
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = part.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                scaling = part.get("rope_scaling")
                factor = scaling.get("factor") if isinstance(scaling, dict) else None
                if isinstance(factor, (int, float)) and factor > 1:
                    return int(value * factor), f"{key} {value} × rope_scaling factor {factor:g}"
                return value, f"{key} {value}"
    return None


def check_context(cfg: TrainConfig) -> None:
    """The prompt bound (--max_length) plus the completion bound within the positions of a local --model folder."""
    m, r, d = cfg.model, cfg.rollout, cfg.data
    if m.model is None or not Path(m.model).is_dir():
        return
    found = model_context(m.model)
    if found is None:
        return
    limit, source = found
    flag = "--max_new_tokens" if r.max_new_tokens is not None else "--max_completion_length"
    if r.max_completion_length > limit:
        raise ConfigError(
            f"{flag} {r.max_completion_length}: the model {m.model} holds {limit} positions ({source} "
            f"in its config.json), so completions would run past its context; use at most {limit}"
        )
    if d.max_length is not None and d.max_length + r.max_completion_length > limit:
        raise ConfigError(
            f"--max_length {d.max_length} + {flag} {r.max_completion_length} = "
            f"{d.max_length + r.max_completion_length} tokens, but the model {m.model} holds {limit} "
            f"positions ({source} in its config.json); lower one so the sum is at most {limit}"
        )
