"""``resolve(cfg) -> TrainConfig``: the defaults that depend on other options, filled in a copy.

Parsing calls it once, between the per-field checks and ``validate`` (which changes nothing); the pipeline calls it
again on the configuration it is given, so a ``TrainConfig`` built in code trains as the parsed one would. It is
idempotent: ``resolve(resolve(cfg)) == resolve(cfg)``. What it fills:

- ms-swift's other spellings: ``--max_new_tokens`` → ``--max_completion_length``, ``--optim adamw_torch`` →
  ``--optimizer adamw`` (an unknown ``--optim`` is left for ``validate`` to refuse);
- ``--kl_in_reward`` unset → true with rloo and reinforce_plus_plus (ms-swift's rule);
- ``--eval_strategy no`` (or unset with ``--save_strategy no``) → no evaluation (``eval_steps`` unset);
- ``--loss_type real`` → ``--scale_rewards none`` (REAL reads only the advantages' signs; said when it replaces a
  value given);
- CHORD's unset warm-up and decay steps → 0;
- ``--structured_outputs_json FILE.json`` → the schema's JSON text (a rollout server may not have the file);
- relative paths → absolute, against the directory the run starts in (``--output_dir`` and
  ``--resume_from_checkpoint`` always; models, datasets, plugin files and a DeepSpeed file when such a file or
  folder exists), so a reward or agent that changes the working directory cannot move the run's files.
"""

from __future__ import annotations

import copy
import json
import logging
import os

from grpokit.config.args import TrainConfig
from grpokit.config.schema import load_json_schema
from grpokit.config.swift_options import is_rank0

logger = logging.getLogger(__name__)

# --optim (transformers' names) -> grpokit's --optimizer; other transformers optimizers are not implemented
OPTIM_NAMES = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "sgd": "sgd"}


def resolve(cfg: TrainConfig) -> TrainConfig:
    """A copy of ``cfg`` with the derived defaults filled; ``cfg`` itself is not changed."""
    out = copy.deepcopy(cfg)
    r, t, a = out.rollout, out.training, out.algorithm
    if a.kl_in_reward is None:
        a.kl_in_reward = a.advantage_estimator in ("rloo", "reinforce_plus_plus")
    if r.max_staleness is not None:  # an explicit bound decides; 0 is synchronous
        r.async_generate = r.max_staleness > 0
    if r.max_new_tokens is not None:
        r.max_completion_length = r.max_new_tokens
    if t.optim in OPTIM_NAMES:
        t.optimizer = OPTIM_NAMES[t.optim]
    if (t.eval_strategy or t.save_strategy) == "no":  # unset, it follows --save_strategy, as in ms-swift
        t.eval_steps, t.eval_on_start, t.eval_on_end = None, False, False
    if a.loss_type == "real" and a.scale_rewards != "none":
        if a.scale_rewards is not None and is_rank0():
            logger.warning(
                "--scale_rewards %s is replaced by none: --loss_type real uses only the sign of each "
                "advantage (as ms-swift, which forces none too)",
                a.scale_rewards,
            )
        a.scale_rewards = "none"
    if a.chord_sft_dataset:
        a.chord_mu_warmup_steps = a.chord_mu_warmup_steps or 0
        a.chord_mu_decay_steps = a.chord_mu_decay_steps or 0
    if r.structured_outputs_json:
        r.structured_outputs_json = json.dumps(load_json_schema(r.structured_outputs_json))
    _absolute_paths(out)
    return out


def _absolute_paths(cfg: TrainConfig) -> None:
    """Relative paths made absolute now (the module docstring); hub ids and ``builtin:`` names stay as given."""
    t, m, d = cfg.training, cfg.model, cfg.data
    t.output_dir = os.path.abspath(t.output_dir)
    if t.resume_from_checkpoint and t.resume_from_checkpoint != "latest":
        t.resume_from_checkpoint = os.path.abspath(t.resume_from_checkpoint)
    m.model, m.ref_model, t.deepspeed = _if_exists(m.model), _if_exists(m.ref_model), _if_exists(t.deepspeed)
    d.dataset, d.val_dataset = [_if_exists(p) for p in d.dataset], [_if_exists(p) for p in d.val_dataset]
    cfg.algorithm.chord_sft_dataset = [_if_exists(p) for p in cfg.algorithm.chord_sft_dataset]
    cfg.reward.reward_model = [_if_exists(p) for p in cfg.reward.reward_model]
    cfg.reward.external_plugins = [_if_exists(p) for p in cfg.reward.external_plugins]


def _if_exists(path: str | None) -> str | None:
    return os.path.abspath(path) if path and not os.path.isabs(path) and os.path.exists(path) else path
