"""The rules between options, in one place, run by ``parse_train_args`` before anything loads; they change nothing.

``validate(cfg)`` takes a resolved configuration (``grpokit.config.resolve``) and raises ``ConfigError`` (one line:
option, value, fix) for the first problem. Order: every value against its own field (``fields.check_fields``:
types, ranges, NaN), ms-swift's names, clashes between options, rollout modes, rewards, paths on disk, the lengths
against a local model folder's context (its config.json), sampling and structured outputs; the registry names;
last, the batch plan (its divisibility rules). Names that an ``--external_plugins`` file may register
(``--loss_type``, ``--advantage_estimator``, ...) are checked by ``check_registry_names``: here when no plugin is
given, else by the pipeline right after it loads the plugins. A check that needs a loaded model (reward columns
against the dataset, the demo model's or a hub model's context) stays with the code that loads it.

Rules that need a component's knowledge (the algorithm registries, the chat template's options, the grammars of
structured outputs) are registered by that component (``config/checks.py``) and run here at their slots: config
imports no runtime package, and ``grpokit train --help`` stays torch-free.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import re
from pathlib import Path

from pydantic import ValidationError

from grpokit.config.args import TrainConfig
from grpokit.config.async_rules import check_staleness
from grpokit.config.checks import run_checks
from grpokit.config.context import check_context
from grpokit.config.fields import check_fields
from grpokit.config.moot import warn_moot_options
from grpokit.config.plan import batch_plan, earlier_run_checkpoints
from grpokit.config.resolve import OPTIM_NAMES
from grpokit.config.reward_args import ISOLATION_MODES
from grpokit.config.rollout_rules import check_rollout_modes
from grpokit.config.swift_options import check_swift_options, is_rank0
from grpokit.config.teacher_args import check_teacher_options
from grpokit.errors import ConfigError
from grpokit.protocol import RequestConfig

logger = logging.getLogger(__name__)


def validate(cfg: TrainConfig, supplied_rewards: int = 0, supplied_eval: bool = False) -> None:
    """Raise ConfigError naming the option, its value and the fix, for the first problem found (ms-swift's options
    warned about: one line each, rank 0). ``cfg`` is not changed. A caller's parts: ``supplied_rewards`` reward
    callables besides --reward_funcs (counted by --reward_weights), ``supplied_eval`` evaluation rows."""
    check_fields(cfg)
    check_swift_options(cfg.swift_options, log=logger.warning)
    warn_moot_options(cfg, supplied_eval)  # ms-swift's options that it accepts and makes moot: one warning each
    _check_swift_names(cfg)
    _check_evaluation(cfg, supplied_eval)
    _check_ref_sync(cfg)
    _real_loss_rules(cfg)
    check_chord_options(cfg)
    check_teacher_options(cfg)  # on-policy distillation (config/teacher_args.py)
    run_checks("data", cfg)  # --columns, --system FILE, --max_length, --agent_template, ... (grpokit.template)
    check_rollout_modes(cfg)  # server mode, multi-turn, vLLM colocate, async generation (config/rollout_rules.py)
    _check_rewards(cfg, supplied_rewards)
    _check_paths(cfg)
    check_context(cfg)
    _check_sampling(cfg)
    if not cfg.reward.external_plugins:  # the registries are final already: check the names now
        check_registry_names(cfg)
    check_staleness(cfg.rollout, batch_plan(cfg))


def check_registry_names(cfg: TrainConfig) -> None:
    """The options whose values are names in registries a plugin may extend (``config/names.py``), with the rules
    that look those names up. They are checked as soon as the registries are final: in ``validate`` when no
    ``--external_plugins`` are given, else by the pipeline right after it loads them (still before any model)."""
    run_checks("names", cfg)  # grpokit/algorithms/option_checks.py


def _real_loss_rules(cfg: TrainConfig) -> None:
    """--loss_type real (REAL, grpokit/algorithms/losses_real.py): whole groups in every micro-batch, and neither the
    entropy mask nor the off-policy sequence mask (they would mask a policy term REAL lacks). Its unscaled rewards are
    ``resolve``'s."""
    a, t, g = cfg.algorithm, cfg.training, cfg.rollout.num_generations
    if a.loss_type != "real":
        return
    if t.per_device_train_batch_size % g:
        raise ConfigError(
            f"--loss_type real classifies whole groups inside each micro-batch, but "
            f"per_device_train_batch_size {t.per_device_train_batch_size} is not a multiple of "
            f"num_generations {g}; use a multiple of {g}"
        )
    if a.top_entropy_quantile < 1.0:
        raise ConfigError(
            f"--top_entropy_quantile {a.top_entropy_quantile} masks a per-token policy term, which "
            "--loss_type real does not have, so it would do nothing; remove it"
        )
    if a.off_policy_sequence_mask_delta is not None:
        raise ConfigError(
            f"--off_policy_sequence_mask_delta {a.off_policy_sequence_mask_delta} masks sequences "
            "out of a per-token policy term, which --loss_type real does not have, so it would do "
            "nothing; remove it"
        )


def json_object(option: str, value) -> dict | None:
    """A JSON-object option (a dict from YAML, or JSON text from a flag) as a dict; None when unset."""
    if value is None or isinstance(value, dict):
        return value
    try:
        out = json.loads(value)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--{option} {value!r}: not valid JSON ({e.msg}); pass an object such as '{{\"key\": value}}'"
        ) from None
    if not isinstance(out, dict):
        raise ConfigError(f"--{option} {value!r}: expected a JSON object such as '{{\"key\": value}}'")
    return out


def _check_swift_names(cfg: TrainConfig) -> None:
    """ms-swift's spellings of grpokit options (older names, transformers' names), the JSON options and the names
    of choices that another library (transformers, multiprocessing) or another layer keeps."""
    m, t = cfg.model, cfg.training
    if t.optim is not None and t.optim not in OPTIM_NAMES:
        raise ConfigError(
            f"--optim {t.optim}: not implemented in grpokit; use one of {', '.join(OPTIM_NAMES)}, "
            "or --optimizer NAME from the optimizers registry (a plugin may add one)"
        )
    json_object("lr_scheduler_kwargs", t.lr_scheduler_kwargs)
    _check_scheduler_name(t.lr_scheduler_type)
    if cfg.reward.code_exec_isolation not in ISOLATION_MODES:
        raise ConfigError(
            f"--code_exec_isolation {cfg.reward.code_exec_isolation}: unknown; use one of {', '.join(ISOLATION_MODES)}"
        )
    gc_kwargs = json_object("gradient_checkpointing_kwargs", m.gradient_checkpointing_kwargs)
    if gc_kwargs and not m.gradient_checkpointing and is_rank0():
        logger.warning(
            "--gradient_checkpointing_kwargs: no effect without --gradient_checkpointing true (ms-swift's "
            "default is true, grpokit's false)"
        )
    if m.attn_impl is not None and m.attn_impl.startswith("flash") and (t.use_cpu or not _cuda()):
        raise ConfigError(
            f"--attn_impl {m.attn_impl}: flash attention needs a CUDA GPU and this run is on the "
            "CPU; use --attn_impl sdpa (or eager)"
        )
    _check_dataloader(t)
    _check_freezing(m)


def _cuda() -> bool:
    import torch  # asked only of a flash --attn_impl: importing config stays torch-free

    return torch.cuda.is_available()


def _check_scheduler_name(name: str) -> None:
    from transformers import SchedulerType

    names = [s.value for s in SchedulerType]
    if name not in names:
        raise ConfigError(
            f"--lr_scheduler_type {name}: unknown; use one of transformers' schedules: {', '.join(names)}"
        )


def _check_evaluation(cfg: TrainConfig, supplied_eval: bool = False) -> None:
    """--num_generations_eval needs evaluation to run (``--eval_steps``, ``--eval_on_start`` or ``--eval_on_end``
    without validation data is one of ``config.moot``'s warnings: ms-swift turns evaluation off there)."""
    t, d = cfg.training, cfg.data
    val = d.val_dataset or d.split_dataset_ratio or supplied_eval
    k = t.num_generations_eval
    if k and not val:
        raise ConfigError(
            f"--num_generations_eval {k} without validation data would never sample; add --val_dataset "
            "FILE and --eval_steps N, or drop it"
        )
    if k and (t.eval_strategy or t.save_strategy) == "no":  # unset, --eval_strategy follows --save_strategy
        said = "--eval_strategy no" if t.eval_strategy else "--save_strategy no (which --eval_strategy follows)"
        raise ConfigError(
            f"--num_generations_eval {k} with {said} would never sample; use --eval_strategy steps "
            "--eval_steps N, or drop it"
        )
    if k and not (t.eval_steps or t.eval_on_start or t.eval_on_end or t.callbacks):  # a callback may evaluate
        raise ConfigError(
            f"--num_generations_eval {k} without --eval_steps (or --eval_on_start true) would never "
            "sample; add --eval_steps N, or drop it"
        )


def _check_ref_sync(cfg: TrainConfig) -> None:
    """--sync_ref_model mixes the policy into a separate reference model; without one it would do nothing."""
    a, m = cfg.algorithm, cfg.model
    if not a.sync_ref_model:
        return
    if a.beta == 0:
        raise ConfigError(
            "--sync_ref_model true with --beta 0: no reference model is loaded (the KL term is off), so "
            "there is nothing to sync; drop --sync_ref_model or set --beta > 0"
        )
    if m.tuner_type == "lora":
        raise ConfigError(
            "--sync_ref_model true with --tuner_type lora: the reference is the base model with the "
            "adapters disabled, which mixing cannot change; drop --sync_ref_model or use --tuner_type "
            "full"
        )


def _check_freezing(m) -> None:
    options = {
        "freeze_parameters": m.freeze_parameters,
        "freeze_parameters_regex": m.freeze_parameters_regex,
        "freeze_parameters_ratio": m.freeze_parameters_ratio,
        "trainable_parameters": m.trainable_parameters,
        "trainable_parameters_regex": m.trainable_parameters_regex,
    }
    given = [name for name, value in options.items() if value]
    if given and m.tuner_type != "full":
        raise ConfigError(
            f"--{given[0]} acts with --tuner_type full (as in ms-swift); with LoRA only the adapters "
            "train: choose them with --target_modules / --target_regex"
        )
    for name in ("freeze_parameters_regex", "trainable_parameters_regex"):
        if options[name] is not None:
            try:
                re.compile(options[name])
            except re.error as e:
                raise ConfigError(f"--{name} {options[name]!r}: not a valid regex ({e})") from None


def _check_dataloader(t) -> None:
    for name in ("dataloader_prefetch_factor", "dataloader_multiprocessing_context"):
        if getattr(t, name) is not None and not t.dataloader_num_workers:
            raise ConfigError(f"--{name} {getattr(t, name)}: acts only with --dataloader_num_workers > 0")
    context = t.dataloader_multiprocessing_context
    if context is not None and context not in multiprocessing.get_all_start_methods():
        raise ConfigError(
            f"--dataloader_multiprocessing_context {context}: not a start method here; use one of "
            f"{', '.join(multiprocessing.get_all_start_methods())}"
        )


def _check_rewards(cfg: TrainConfig, supplied: int = 0) -> None:
    r, w = cfg.rollout, cfg.reward
    gym = r.multi_turn_scheduler in ("gym_scheduler", "OpenEnvScheduler", "openenv_scheduler")
    if w.reward_weights:
        funcs = w.reward_funcs or ([] if (w.reward_model or gym or supplied) else ["accuracy"])
        n = len(funcs) + supplied + len(w.reward_model) + int(gym)
        if len(w.reward_weights) != n:
            order = "functions first, then models" + (", then gym_reward" if gym else "")
            raise ConfigError(
                f"--reward_weights has {len(w.reward_weights)} value(s) but there are {n} reward "
                f"function(s) and model(s); give one weight each ({order})"
            )
    if w.reward_model_plugin and len(w.reward_model_plugin) != len(w.reward_model):
        raise ConfigError(
            f"--reward_model_plugin has {len(w.reward_model_plugin)} name(s) for "
            f"{len(w.reward_model)} --reward_model(s); give one each"
        )


def _check_paths(cfg: TrainConfig) -> None:
    m, w, t = cfg.model, cfg.reward, cfg.training
    if m.model is not None and not Path(m.model).exists() and not _looks_like_hub_id(m.model):
        raise ConfigError(f"--model {m.model}: no such folder; pass a local model folder in Hugging Face format")
    if m.model is not None and Path(m.model).is_dir() and not (Path(m.model) / "config.json").is_file():
        raise ConfigError(f"--model {m.model}: folder has no config.json; pass a Hugging Face model folder")
    for path in w.reward_model:
        if not Path(path).exists():
            raise ConfigError(f"--reward_model {path}: not found; pass a local sequence-classification model folder")
    resume = t.resume_from_checkpoint
    if resume and resume != "latest" and not Path(resume).is_dir():
        raise ConfigError(f"--resume_from_checkpoint {resume}: no such folder; pass a checkpoint-N folder or 'latest'")
    if not resume:
        earlier_run_checkpoints(t.output_dir, t.overwrite_output_dir)


def _check_sampling(cfg: TrainConfig) -> None:
    """The sampling options within the bounds every engine enforces on a request (``grpokit.protocol``), and a
    bad regex/schema, fail here rather than at the first rollout (``resolve`` has read a schema file into its text)."""
    r = cfg.rollout
    try:
        RequestConfig(
            max_tokens=r.max_completion_length,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            repetition_penalty=r.repetition_penalty,
            stop=list(r.stop_words),
        )
    except ValidationError as e:
        err = e.errors()[0]
        field = {"max_tokens": "max_completion_length", "stop": "stop_words"}.get(str(err["loc"][0]), err["loc"][0])
        raise ConfigError(f"--{field} {err.get('input')!r}: {err['msg']}") from None
    run_checks("sampling", cfg)  # a regex or schema that does not compile (grpokit/engines/option_checks.py)


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


# ---- CHORD (algorithms/chord.py, trainers/chord_sft.py) ----------------------------------------------------------
_CHORD_SETTINGS = (
    "chord_sft_per_device_train_batch_size",
    "chord_mu_warmup_steps",
    "chord_mu_decay_steps",
    "chord_mu_peak",
    "chord_mu_valley",
)


def check_chord_options(cfg: TrainConfig) -> None:
    """The CHORD options: all or nothing with --chord_sft_dataset, and mu's peak ≥ its valley (each in [0, 1] by
    its field; ``resolve`` sets the unset warm-up and decay steps to 0, where ms-swift needs them set)."""
    a = cfg.algorithm
    if not a.chord_sft_dataset:
        given = [n for n in _CHORD_SETTINGS if getattr(a, n) is not None]
        given += ["chord_enable_phi_function"] if a.chord_enable_phi_function else []
        if given:
            raise ConfigError(
                f"--{given[0]} {getattr(a, given[0])}: acts only with CHORD; add --chord_sft_dataset "
                "(expert rows for the SFT term), or drop it"
            )
        return
    for name in ("chord_sft_per_device_train_batch_size", "chord_mu_peak", "chord_mu_valley"):
        if getattr(a, name) is None:
            raise ConfigError(
                f"--chord_sft_dataset needs --{name}; e.g. --chord_sft_per_device_train_batch_size 1 "
                "--chord_mu_peak 0.9 --chord_mu_valley 0.05 (peak = valley: a constant mu)"
            )
    if a.chord_mu_peak < a.chord_mu_valley:
        raise ConfigError(
            f"--chord_mu_peak {a.chord_mu_peak} is below --chord_mu_valley {a.chord_mu_valley}: mu "
            "decays from the peak to the valley; swap them, or set both equal for a constant mu"
        )
