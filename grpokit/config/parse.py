"""argv / YAML → `TrainConfig`, validated before anything heavy loads.

Flags are parsed by `transformers.HfArgumentParser` into the dataclasses of `args.py`; `--config file.yaml`
supplies defaults that flags override. `grpokit train` with neither `--model` nor `--dataset` runs the built-in
demo (`demo.yaml`).
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from grpokit.config.args import ALL_GROUPS, TrainConfig
from grpokit.config.names import REGISTRIES, check_loss_type_pair, help_suffix
from grpokit.errors import ConfigError

logger = logging.getLogger(__name__)

DEMO_YAML = Path(__file__).with_name("demo.yaml")


def _make_parser(prog: str):
    from transformers import HfArgumentParser

    class Parser(HfArgumentParser):
        def error(self, message: str):  # one line, no usage dump
            raise ConfigError(f"{self.prog}: {message} (see `{self.prog} --help`)")

    parser = Parser(ALL_GROUPS, prog=prog)
    parser.add_argument("--config", type=str, default=None, help="YAML file of options; flags override it")
    for action in parser._actions:
        if action.dest in REGISTRIES:  # registry names: listed, checked after the plugins load
            action.help += help_suffix(action.dest)
            action.metavar = "NAME"
    return parser


def _load_plugins_for_help(argv: list[str]) -> None:
    """`grpokit train --external_plugins p.py --help`: load the plugins first, so the help lists their names."""
    import argparse

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--external_plugins", "--external-plugins", nargs="*", default=[])
    known, _ = pre.parse_known_args(argv)
    if known.external_plugins:
        from grpokit.plugins.loader import load_plugins_once

        load_plugins_once(known.external_plugins)


def _known_flags(parser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


def _check_unknown(parser, extra: list[str]) -> None:
    flags = [a for a in extra if a.startswith("--")]
    if not extra:
        return
    if not flags:
        raise ConfigError(f"unexpected value(s) {extra}: every value follows a --flag (see --help)")
    name = flags[0].split("=", 1)[0]
    close = difflib.get_close_matches(name, _known_flags(parser), n=3)
    hint = f"; did you mean {' or '.join(close)}?" if close else "; see `grpokit train --help`"
    raise ConfigError(f"unknown option {name}{hint}")


def _load_yaml(path: str, parser) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config {path}: file not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({e.__class__.__name__}: {str(e).splitlines()[0]})")
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option: value")
    known = {f[2:] for f in _known_flags(parser)}
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"--config {path}: unknown option {key!r}{hint}")
    return data


def parse_train_args(argv: list[str] | None = None, prog: str = "grpokit train") -> TrainConfig:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        _load_plugins_for_help(argv)
    parser = _make_parser(prog)
    pre, _ = parser.parse_known_args(argv)
    defaults: dict = {}
    if pre.config:
        defaults.update(_load_yaml(pre.config, parser))
    user_keys = set(defaults) | {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}
    if any(a.split("=", 1)[0] == "--vllm_server_api_key" for a in argv):
        logger.warning("--vllm_server_api_key on the command line is readable by every process on this host "
                       "(/proc/PID/cmdline, ps); set GRPOKIT_API_KEY in the environment instead")
    if "model" not in user_keys and "dataset" not in user_keys:
        demo = yaml.safe_load(DEMO_YAML.read_text())
        defaults = {**demo, **defaults}
    if defaults:
        parser.set_defaults(**defaults)
    *groups, extra = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    _check_unknown(parser, extra)
    groups = [g for g in groups if type(g) in ALL_GROUPS]
    cfg = TrainConfig(*groups)
    validate(cfg)
    return cfg


@dataclass(frozen=True)
class BatchPlan:
    """How completions are split into rollouts, micro-steps and optimizer steps."""

    world_size: int
    num_generations: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    num_iterations: int

    @property
    def generation_batch_size(self) -> int:  # completions per rollout, all processes
        return self.per_device_train_batch_size * self.steps_per_generation * self.world_size

    @property
    def prompts_per_rollout(self) -> int:
        return self.generation_batch_size // self.num_generations

    @property
    def micro_steps_per_window(self) -> int:
        return self.steps_per_generation * self.num_iterations

    @property
    def optimizer_steps_per_window(self) -> int:
        return self.micro_steps_per_window // self.gradient_accumulation_steps

    def describe(self) -> str:
        w = f" over {self.world_size} processes" if self.world_size > 1 else ""
        micro = "micro-step" if self.steps_per_generation == 1 else "micro-steps"
        return (
            f"batch plan: {self.prompts_per_rollout} prompts × {self.num_generations} generations = "
            f"{self.generation_batch_size} completions per rollout{w}; "
            f"{self.steps_per_generation} {micro} of {self.per_device_train_batch_size} per process"
            f"{f' × {self.num_iterations} iterations' if self.num_iterations > 1 else ''}; "
            f"{self.optimizer_steps_per_window} optimizer step(s) per rollout "
            f"(gradient_accumulation_steps={self.gradient_accumulation_steps})"
        )


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _divisors_hint(total: int, g: int) -> str:
    ok_g = [d for d in range(2, total + 1) if total % d == 0][:6]
    lo, hi = (total // g) * g, (total // g + 1) * g
    sizes = " or ".join(str(s) for s in (lo, hi) if s > 0)
    return f"use num_generations {', '.join(map(str, ok_g)) or '1'}, or a generation batch of {sizes}"


def batch_plan(cfg: TrainConfig, world: int | None = None) -> BatchPlan:
    t, r, a = cfg.training, cfg.rollout, cfg.algorithm
    world = world or world_size()
    b, gas = t.per_device_train_batch_size, t.gradient_accumulation_steps
    if t.generation_batch_size is not None and t.steps_per_generation is not None:
        raise ConfigError("--generation_batch_size and --steps_per_generation both set: give only one")
    if t.generation_batch_size is not None:
        per_step = b * world
        if t.generation_batch_size % per_step:
            raise ConfigError(
                f"--generation_batch_size {t.generation_batch_size} must be a multiple of per_device_train_batch_"
                f"size × processes = {b} × {world} = {per_step}")
        spg = t.generation_batch_size // per_step
    else:
        spg = t.steps_per_generation or gas
    plan = BatchPlan(world, r.num_generations, b, gas, spg, a.num_iterations)
    gbs = plan.generation_batch_size
    if gbs % r.num_generations:
        raise ConfigError(
            f"the generation batch {gbs} (= per_device_train_batch_size {b} × steps_per_generation {spg} × "
            f"{world} process(es)) is not divisible by num_generations {r.num_generations}; "
            + _divisors_hint(gbs, r.num_generations))
    if plan.micro_steps_per_window % gas:
        raise ConfigError(
            f"steps_per_generation × num_iterations = {spg} × {a.num_iterations} micro-steps per rollout is not a "
            f"multiple of gradient_accumulation_steps {gas}; set --steps_per_generation to a multiple of {gas}")
    return plan


def _positive(name: str, value, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"--{name} {value}: must be {'≥ 0' if allow_zero else '> 0'}")


def validate(cfg: TrainConfig) -> None:
    """Checks that need no model: ranges, clashes, files that must exist; then the --external_plugins are
    imported and the registry names (--loss_type, --advantage_estimator, ...) checked against what is registered."""
    t, r, a, w, m = cfg.training, cfg.rollout, cfg.algorithm, cfg.reward, cfg.model
    for name, value in [("num_generations", r.num_generations), ("max_completion_length", r.max_completion_length),
                        ("per_device_train_batch_size", t.per_device_train_batch_size),
                        ("gradient_accumulation_steps", t.gradient_accumulation_steps),
                        ("num_iterations", a.num_iterations), ("logging_steps", t.logging_steps),
                        ("save_steps", t.save_steps), ("learning_rate", t.learning_rate)]:
        _positive(name, value)
    for name, value in [("temperature", r.temperature), ("beta", a.beta), ("epsilon", a.epsilon),
                        ("epsilon_high", a.epsilon_high), ("weight_decay", t.weight_decay),
                        ("max_grad_norm", t.max_grad_norm), ("warmup_ratio", t.warmup_ratio)]:
        _positive(name, value, allow_zero=True)
    if r.num_generations < 2:
        raise ConfigError(f"--num_generations {r.num_generations}: GRPO needs at least 2 completions per prompt "
                          "to compare; use 2 or more")
    if r.temperature == 0:
        raise ConfigError("--temperature 0: greedy sampling gives every completion of a group the same reward and "
                          "no learning signal; use a temperature > 0 (e.g. 1.0)")
    gym = r.multi_turn_scheduler == "gym_scheduler"
    if r.vllm_mode == "server" and (r.multi_turn_scheduler or r.gym_env or r.max_turns):
        raise ConfigError("in server mode the rollout server runs the trajectories: pass --multi_turn_scheduler, "
                          "--max_turns and --gym_env to `grpokit rollout`, not to `grpokit train`")
    if r.multi_turn_scheduler is None and (r.gym_env or r.loss_scale != "default" or r.max_turns):
        raise ConfigError("--gym_env, --loss_scale and --max_turns act on multi-turn rollouts; add "
                          "--multi_turn_scheduler NAME (e.g. gym_scheduler, thinking_tips_scheduler)")
    if w.reward_weights:
        funcs = w.reward_funcs or ([] if (w.reward_model or gym) else ["accuracy"])
        n = len(funcs) + len(w.reward_model) + int(gym)
        if len(w.reward_weights) != n:
            raise ConfigError(f"--reward_weights has {len(w.reward_weights)} value(s) but there are {n} reward "
                              f"function(s) and model(s); give one weight each (functions first, then models{', then gym_reward' if gym else ''})")
    if w.reward_model_plugin and len(w.reward_model_plugin) != len(w.reward_model):
        raise ConfigError(f"--reward_model_plugin has {len(w.reward_model_plugin)} name(s) for "
                          f"{len(w.reward_model)} --reward_model(s); give one each")
    if m.model is not None and not Path(m.model).exists() and not _looks_like_hub_id(m.model):
        raise ConfigError(f"--model {m.model}: no such folder; pass a local model folder in Hugging Face format")
    if m.model is not None and Path(m.model).is_dir() and not (Path(m.model) / "config.json").is_file():
        raise ConfigError(f"--model {m.model}: folder has no config.json; pass a Hugging Face model folder")
    for path in w.reward_model:
        if not Path(path).exists():
            raise ConfigError(f"--reward_model {path}: not found; pass a local sequence-classification model folder")
    if r.vllm_mode == "server" and not (r.vllm_server_host or r.vllm_server_base_url):
        raise ConfigError("--vllm_mode server needs --vllm_server_host H --vllm_server_port P "
                          "(or --vllm_server_base_url URL)")
    if r.vllm_server_host and len(r.vllm_server_port) not in (1, len(r.vllm_server_host)):
        raise ConfigError(f"{len(r.vllm_server_host)} --vllm_server_host value(s) but {len(r.vllm_server_port)} "
                          "--vllm_server_port value(s); give one port, or one per host")
    if r.max_turns is not None and r.max_turns < 1:
        raise ConfigError(f"--max_turns {r.max_turns}: must be ≥ 1")
    if a.dynamic_sample and a.max_resample_times < 0:
        raise ConfigError(f"--max_resample_times {a.max_resample_times}: must be ≥ 0")
    if t.resume_from_checkpoint and t.resume_from_checkpoint != "latest" and not Path(
            t.resume_from_checkpoint).is_dir():
        raise ConfigError(f"--resume_from_checkpoint {t.resume_from_checkpoint}: no such folder; pass a "
                          "checkpoint-N folder or 'latest'")
    if not t.resume_from_checkpoint:
        earlier_run_checkpoints(t.output_dir, t.overwrite_output_dir)
    from grpokit.plugins.loader import load_plugins_once

    load_plugins_once(w.external_plugins)  # they may register the names checked next
    _validate_algorithm(cfg)
    _validate_structured(cfg)
    batch_plan(cfg)


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """The ``checkpoint-N`` folders in ``output_dir``, oldest step first."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def earlier_run_checkpoints(output_dir: str | Path, overwrite: bool) -> list[Path]:
    """Checkpoints an earlier run left in ``output_dir``, which a fresh run may replace only when told to:
    otherwise rotation would delete the new run's checkpoints in favour of the earlier run's higher-numbered ones
    and ``--resume_from_checkpoint latest`` would pick those up."""
    earlier = checkpoint_dirs(output_dir)
    if earlier and not overwrite:
        names = ", ".join(p.name for p in earlier[:3]) + (", …" if len(earlier) > 3 else "")
        raise ConfigError(f"--output_dir {output_dir} holds checkpoints of an earlier run ({names}): continue it with "
                          "--resume_from_checkpoint latest, choose another --output_dir, or pass "
                          "--overwrite_output_dir true to delete them")
    return earlier


def _validate_structured(cfg: TrainConfig) -> None:
    """A bad regex/schema fails here, before any model loads; a schema file is read now (a rollout server may
    not have the file)."""
    r = cfg.rollout
    if not (r.structured_outputs_regex or r.structured_outputs_json):
        return
    import json

    from grpokit.engines.structured import check_structured_options, load_json_schema

    if r.structured_outputs_json:
        r.structured_outputs_json = json.dumps(load_json_schema(r.structured_outputs_json))
    check_structured_options(r.structured_outputs_regex, r.structured_outputs_json)


def loss_config(cfg: TrainConfig):
    """The loss slice of the configuration. cispo's default cap 5.0 is grpokit's: the value the docs of ms-swift
    (CISPO page) and TRL (epsilon_high) recommend after ScaleRL; the code of both falls back to --epsilon."""
    from grpokit.algorithms import LossConfig

    a = cfg.algorithm
    high = a.epsilon_high
    if high is None:
        high = 5.0 if a.loss_type == "cispo" else a.epsilon
    return LossConfig(loss_type=a.loss_type, importance_sampling_level=a.importance_sampling_level,
                      epsilon_low=a.epsilon, epsilon_high=high, delta=a.delta,
                      beta=0.0 if a.kl_in_reward else a.beta, tau_pos=a.tau_pos, tau_neg=a.tau_neg,
                      max_completion_length=cfg.rollout.max_completion_length, vespo_k_pos=a.vespo_k_pos,
                      vespo_lambda_pos=a.vespo_lambda_pos, vespo_k_neg=a.vespo_k_neg,
                      vespo_lambda_neg=a.vespo_lambda_neg,
                      rollout_importance_sampling_mode=a.rollout_importance_sampling_mode)


def _validate_algorithm(cfg: TrainConfig) -> None:
    from grpokit.algorithms import (
        validate_advantage_options,
        validate_entropy_quantile,
        validate_loss_config,
        validate_rollout_is_options,
    )

    a = cfg.algorithm
    check_loss_type_pair(a.loss_type)
    validate_advantage_options(a.advantage_estimator, a.scale_rewards, a.kl_in_reward and a.beta != 0)
    validate_loss_config(loss_config(cfg))
    validate_entropy_quantile(a.top_entropy_quantile)
    validate_rollout_is_options(a.rollout_importance_sampling_mode, a.rollout_importance_sampling_threshold)


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))
