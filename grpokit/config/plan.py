"""The batch plan (how completions split into rollouts, micro-steps and optimizer steps, checked for whole groups)
and the run folder's checkpoints. Torch-free: the CLI prints the plan before anything heavy loads."""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path

from grpokit.config.args import TrainConfig
from grpokit.errors import ConfigError
from grpokit.protocol import MAX_N

_CHECKPOINT_NAME = re.compile(r"checkpoint-\d+")


def eval_due(training, step: int, max_steps: int) -> bool:
    """Whether the run evaluates after optimizer step ``step``: every --eval_steps, and after the last step with
    --eval_on_end (``training``: the TrainingArguments)."""
    return bool(training.eval_steps and step % training.eval_steps == 0) or (training.eval_on_end and step == max_steps)


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
    ok_g = list(itertools.islice((d for d in range(2, min(total, MAX_N) + 1) if total % d == 0), 6))
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
                f"size × processes = {b} × {world} = {per_step}"
            )
        spg = t.generation_batch_size // per_step
    else:
        spg = t.steps_per_generation or gas
    plan = BatchPlan(world, r.num_generations, b, gas, spg, a.num_iterations)
    gbs = plan.generation_batch_size
    if gbs % r.num_generations:
        raise ConfigError(
            f"the generation batch {gbs} (= per_device_train_batch_size {b} × steps_per_generation {spg} × "
            f"{world} process(es)) is not divisible by num_generations {r.num_generations}; "
            + _divisors_hint(gbs, r.num_generations)
        )
    if plan.micro_steps_per_window % gas:
        raise ConfigError(
            f"steps_per_generation × num_iterations = {spg} × {a.num_iterations} micro-steps per rollout is not a "
            f"multiple of gradient_accumulation_steps {gas}; set --steps_per_generation to a multiple of {gas}"
        )
    return plan


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """The ``checkpoint-N`` folders in ``output_dir``, oldest step first. Exactly that name: a folder being
    written (``checkpoint-N.tmp``) or set aside (``checkpoint-N.abandoned``, ``.unusable``) is not listed."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if _CHECKPOINT_NAME.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]))


def earlier_run_checkpoints(output_dir: str | Path, overwrite: bool) -> list[Path]:
    """Checkpoints an earlier run left in ``output_dir``, which a fresh run may replace only when told to:
    otherwise rotation would delete the new run's checkpoints in favour of the earlier run's higher-numbered ones
    and ``--resume_from_checkpoint latest`` would pick those up."""
    earlier = checkpoint_dirs(output_dir)
    if earlier and not overwrite:
        names = ", ".join(p.name for p in earlier[:3]) + (", …" if len(earlier) > 3 else "")
        raise ConfigError(
            f"--output_dir {output_dir} holds checkpoints of an earlier run ({names}): continue it with "
            "--resume_from_checkpoint latest, choose another --output_dir, or pass "
            "--overwrite_output_dir true to delete them"
        )
    return earlier
