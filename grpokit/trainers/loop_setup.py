"""Set-up and tear-down half of GRPOTrainer: accelerator, optimizer, engine wiring, checkpoints, outputs."""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import sys
from pathlib import Path

import torch

from grpokit.config.plan import checkpoint_dirs, earlier_run_checkpoints
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.modeling import resolve_dtype_name
from grpokit.rewards.runner import RewardRunner
from grpokit.rollout.evaluate import evaluate_rows
from grpokit.errors import ConfigError
from grpokit.rollout.scheduler import RolloutScheduler
from grpokit.template.encode import ChatTemplate
from grpokit.trainers.distributed import accelerate_plugins, check_backend, check_engine, full_state_dict, use_cpu
from grpokit.trainers.optimizers import optimizers_map
from grpokit.trainers.outputs import JsonlLog, MetricsAccumulator, PlainProgress, plot_curves, summary_text

logger = logging.getLogger(__name__)
STATE_FILE = "trainer_state.json"


class LoopSetupMixin:
    # -- set-up ----------------------------------------------------------------------------------------------
    def _setup_accelerator_and_model(self, model, ref_model) -> None:
        from accelerate import Accelerator
        from accelerate.utils import set_seed
        from transformers import get_scheduler

        t, m = self.args, self.cfg.model
        report = [r for r in t.report_to if r != "none"]
        wants_bf16 = resolve_dtype_name(m.torch_dtype) == "bfloat16"
        mixed = "bf16" if (wants_bf16 and next(model.parameters()).dtype == torch.float32) else "no"
        self.accelerator = Accelerator(
            gradient_accumulation_steps=t.gradient_accumulation_steps, cpu=use_cpu(t), mixed_precision=mixed,
            log_with=report or None, project_dir=t.output_dir, **self._plugin_kwargs(),
            # the loop steps the scheduler once per optimizer step; accelerate would otherwise step it once per
            # process (it assumes a DataLoader sharded over processes), decaying N× too fast under N processes
            step_scheduler_with_optimizer=False)
        check_backend(self.accelerator, t)
        set_seed(t.seed, device_specific=True)  # seed + rank: ranks sample different completions
        if self.plan.prompts_per_rollout % self.accelerator.num_processes:
            raise ConfigError(
                f"{self.plan.prompts_per_rollout} prompts per rollout cannot be split over "
                f"{self.accelerator.num_processes} processes with whole groups; make generation_batch_size / "
                f"num_generations a multiple of {self.accelerator.num_processes}")
        self.state.max_steps = self._total_steps()
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("the model has no trainable parameters (check --tuner_type/--target_modules)")
        optimizer = optimizers_map.get_or_raise(t.optimizer)(params, t)
        warmup = math.ceil(t.warmup_ratio * self.state.max_steps)
        try:
            scheduler = get_scheduler(t.lr_scheduler_type, optimizer, num_warmup_steps=warmup,
                                      num_training_steps=self.state.max_steps)
        except ValueError as e:
            raise ConfigError(f"--lr_scheduler_type {t.lr_scheduler_type}: {str(e).splitlines()[0]}") from e
        self.model, self.optimizer, self.lr_scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        # the model inside any DDP/DeepSpeed wrapper, fixed from here on (unwrap_model walks every module and
        # probes imports on each call)
        self.policy = self.accelerator.unwrap_model(self.model)
        self._worth_sharing: dict[int, bool] = {}  # id(model) → whether prompt sharing pays off
        self._trainable_params = [p for p in self.model.parameters() if p.requires_grad]
        self.ref_model = None
        if self.cfg.algorithm.beta != 0 and not self._is_peft(model):
            if ref_model is None:
                raise ConfigError("beta != 0 with full fine-tuning needs a reference model (the pipeline loads one)")
            self.ref_model = self.accelerator.prepare_model(ref_model, evaluation_mode=True)
            self.ref_model.eval().requires_grad_(False)
        self.template = ChatTemplate(self.tokenizer)

    def _plugin_kwargs(self) -> dict:
        return accelerate_plugins(self.args)

    @staticmethod
    def _is_peft(model) -> bool:
        return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")

    def _total_steps(self) -> int:
        t = self.args
        if t.max_steps > 0:
            return t.max_steps
        windows = math.ceil(t.num_train_epochs * len(self.train_dataset) / self.plan.prompts_per_rollout)
        return max(1, windows * self.plan.optimizer_steps_per_window)

    def _setup_rollout(self, scheduler, engine) -> None:
        self.engine = engine or TransformersEngine(self.policy, self.template)
        if isinstance(self.engine, TransformersEngine):
            self.engine.fast_decode = self.cfg.rollout.fast_decode
        check_engine(self.accelerator, self.engine)
        self.engine.infer_on_loop_thread = True  # our own rollout loop: generate on this thread (engines/base.py)
        self.scheduler = scheduler or RolloutScheduler(self.engine)
        if self.scheduler.infer_engine is None:
            self.scheduler.infer_engine = self.engine
        self.async_generate = self.cfg.rollout.async_generate
        if self.async_generate and self.engine.engine_type == "transformers":
            raise ConfigError("--async_generate true needs an engine with its own copy of the weights (--vllm_mode "
                              "server, or --use_vllm true): the in-process transformers engine samples from the "
                              "live training weights, which change while the next window would be generating")
        self._pending = None  # (future, prompts, step submitted) of the rollout generated ahead
        self._last_sync_s = 0.0
        self._executor = None
        self._orders: dict = {}
        self._read_ahead: dict[int, dict] = {}  # prompt-stream position → dataset row, read ahead
        self._timing = {"rollout": 0.0, "reward": 0.0, "logps": 0.0, "train": 0.0}
        self._window_metrics: dict = {}
        self._warned_no_signal = False

    def _setup_rewards(self, funcs, names, weights) -> None:
        funcs = list(funcs or [])
        self.reward_names = list(names or [getattr(f, "__name__", type(f).__name__) for f in funcs])
        self._uses_env_reward = bool(getattr(self.scheduler, "uses_env_reward", False))
        if self._uses_env_reward:
            self.reward_names.append("gym_reward")
        w = list(weights) if weights else [1.0] * len(self.reward_names)
        if len(w) == len(self.reward_names) - 1 and self._uses_env_reward:
            w.append(1.0)
        if len(w) != len(self.reward_names):
            raise ConfigError(f"{len(w)} reward weight(s) for {len(self.reward_names)} reward(s) "
                              f"({', '.join(self.reward_names)}); give one weight each")
        if not self.reward_names:
            raise ConfigError("no reward: pass --reward_funcs NAME (e.g. accuracy) or --reward_model PATH")
        self._weights = torch.tensor(w, dtype=torch.float32)
        self.reward_runner = RewardRunner(funcs, self.reward_names[: len(funcs)]) if funcs else None

    def _setup_outputs(self) -> None:
        self.output_dir = Path(self.args.output_dir)
        main = self.accelerator.is_main_process
        if main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "args.json").write_text(json.dumps(self.cfg.flat(), indent=2, default=str))
        self._log_file = JsonlLog(self.output_dir / "logging.jsonl", enabled=main)
        self._completions_file = JsonlLog(self.output_dir / "completions.jsonl",
                                          enabled=main and self.args.log_completions)
        self._step_metrics = MetricsAccumulator()
        report = [r for r in self.args.report_to if r != "none"]
        if report:
            self.accelerator.init_trackers("grpokit", config={k: str(v) for k, v in self.cfg.flat().items()})

    def _timing_metrics(self) -> dict:
        return {f"timing/{k}": round(v, 4) for k, v in self._timing.items()}

    PROGRESS_INTERVAL_S = 30.0  # plain lines: a line for the first step that ends this long after the last line

    def _progress_bar(self):
        """A tqdm bar on a terminal; plain lines (``PlainProgress``) when stderr is not one or with
        --disable_tqdm true; nothing on the other processes."""
        main = self.accelerator.is_main_process
        if main and (self.args.disable_tqdm or not sys.stderr.isatty()):
            return PlainProgress(self.state.max_steps, self.state.global_step, self.PROGRESS_INTERVAL_S)
        from tqdm.auto import tqdm

        return tqdm(total=self.state.max_steps, initial=self.state.global_step, desc="train", unit="step",
                    disable=not main, dynamic_ncols=True)

    # -- checkpoints -----------------------------------------------------------------------------------------
    def _save_checkpoint(self) -> Path:
        step = self.state.global_step
        ckpt = self.output_dir / f"checkpoint-{step}"
        self.accelerator.wait_for_everyone()
        self.accelerator.save_state(str(ckpt / "state"))
        state_dict = full_state_dict(self.accelerator, self.model)  # a collective when weights are sharded
        if self.accelerator.is_main_process:
            self.accelerator.unwrap_model(self.model).save_pretrained(ckpt, state_dict=state_dict,
                                                                      safe_serialization=True)
            self.tokenizer.save_pretrained(ckpt)
            in_flight = self.plan.prompts_per_rollout if self._pending is not None else 0  # not trained on yet
            loop = {"global_step": step, "prompts_consumed": self.state.prompts_consumed - in_flight,
                    "max_steps": self.state.max_steps, "python_random": repr(random.getstate()[1][:3])}
            (ckpt / STATE_FILE).write_text(json.dumps(loop, indent=2))
            self._rotate_checkpoints()
        self.accelerator.wait_for_everyone()
        self._call("on_save", str(ckpt))
        return ckpt

    def _rotate_checkpoints(self) -> None:
        limit = self.args.save_total_limit
        if not limit:
            return
        for old in checkpoint_dirs(self.output_dir)[:-limit]:
            shutil.rmtree(old, ignore_errors=True)

    def _clear_earlier_run(self) -> None:
        """A fresh run starts with an output_dir of its own: an earlier run's checkpoints are deleted when
        --overwrite_output_dir allows it (refused otherwise), and its log rows dropped so they cannot mix into
        this run's logs and plots."""
        earlier = earlier_run_checkpoints(self.output_dir, self.args.overwrite_output_dir)
        if self.accelerator.is_main_process:
            for old in earlier:
                shutil.rmtree(old, ignore_errors=True)
            self._log_file.truncate_after(0)
            self._completions_file.truncate_after(0)
        self.accelerator.wait_for_everyone()

    def _maybe_resume(self) -> None:
        path = self.args.resume_from_checkpoint
        if path == "latest":
            ckpts = [c for c in checkpoint_dirs(self.output_dir) if (c / STATE_FILE).is_file()]
            if not ckpts:
                logger.warning("--resume_from_checkpoint latest: no checkpoint in %s; starting fresh", self.output_dir)
            path = str(ckpts[-1]) if ckpts else None
        if not path:
            self._clear_earlier_run()
            return
        ckpt = Path(path)
        if not (ckpt / STATE_FILE).is_file():
            raise ConfigError(f"--resume_from_checkpoint {path}: not a grpokit checkpoint (no {STATE_FILE})")
        self.accelerator.load_state(str(ckpt / "state"))
        loop = json.loads((ckpt / STATE_FILE).read_text())
        self.state.global_step = loop["global_step"]
        self.state.prompts_consumed = loop["prompts_consumed"]
        self._log_file.truncate_after(self.state.global_step)
        self._completions_file.truncate_after(self.state.global_step)
        self.engine.sync_weights(self.policy)
        logger.info("resumed from %s at step %d", ckpt, self.state.global_step)

    # -- the end ---------------------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Greedy completions on the validation set, scored with the reward functions."""
        rows = [self.eval_dataset[i] for i in range(len(self.eval_dataset))]
        result = evaluate_rows(self.engine, self.template, rows, self.reward_runner, self.reward_names,
                               max_tokens=self.cfg.rollout.max_completion_length)
        logs = {"step": self.state.global_step, **{f"eval/{k}": v for k, v in result.metrics.items()}}
        if self.accelerator.is_main_process:
            self._log_file.write(logs)
        return logs

    def _finish(self) -> None:
        self.accelerator.wait_for_everyone()
        final_ckpt = self._save_checkpoint()
        extra = {"logs": str(self.output_dir / "logging.jsonl"), "last checkpoint": str(final_ckpt)}
        state_dict = full_state_dict(self.accelerator, self.model) if self.args.save_final_model else None
        if self.accelerator.is_main_process:
            if self.args.save_final_model:
                final = self.output_dir / "final_model"
                self.accelerator.unwrap_model(self.model).save_pretrained(final, state_dict=state_dict,
                                                                          safe_serialization=True)
                self.tokenizer.save_pretrained(final)
                extra["final model"] = str(final)
            rows = self._log_file.rows()
            if self.args.plots:
                plots = plot_curves([r for r in rows if "loss" in r], self.output_dir)
                if plots:
                    extra["plots"] = ", ".join(p.name for p in plots)
            if self.args.log_completions:
                extra["completions"] = str(self.output_dir / "completions.jsonl")
            print(summary_text([r for r in rows if "loss" in r], self.output_dir, extra), flush=True)
        self._call("on_train_end")
        self.engine.close()
        if self.reward_runner is not None:
            self.reward_runner.close()
        self.accelerator.end_training()
