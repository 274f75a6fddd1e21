"""GRPOTrainer: an explicit training loop over `accelerate`.

One rollout per window; the window's batch is reused for ``steps_per_generation × num_iterations`` micro-steps,
then thrown away (the seed's buffered ``_prepare_inputs``, here visible in ``train()``). The math lives in
``grpokit.algorithms``; this class is glue. Every ``_method`` below is an override point (see docs/plugins.md).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from grpokit.algorithms import (
    LossInputs,
    compute_policy_loss,
    ema_update_,
    entropy_from_logits,
    entropy_mask,
    entropy_threshold,
    loss_mask,
    rollout_importance_weights,
    selective_log_softmax,
)
from grpokit.config.args import TrainConfig
from grpokit.config.plan import batch_plan
from grpokit.config.validate import loss_config
from grpokit.trainers.batch import RolloutBatch
from grpokit.trainers.distributed import mean_over_processes, scalar
from grpokit.trainers.loop_setup import LoopSetupMixin
from grpokit.engines.prefix import completion_logits, worth_sharing
from grpokit.trainers.rollout_step import RolloutStepMixin

logger = logging.getLogger(__name__)


@dataclass
class TrainerState:
    global_step: int = 0  # optimizer steps done
    max_steps: int = 0
    prompts_consumed: int = 0  # position in the prompt stream (resumable)
    windows: int = 0
    last_logs: dict = field(default_factory=dict)


class GRPOTrainer(RolloutStepMixin, LoopSetupMixin):
    def __init__(self, model, tokenizer, cfg: TrainConfig, train_dataset, eval_dataset=None, reward_funcs=None,
                 reward_names=None, reward_weights=None, ref_model=None, scheduler=None, engine=None,
                 callbacks=None) -> None:
        self.cfg = cfg
        self.args = cfg.training
        self.plan = batch_plan(cfg)
        self.tokenizer = tokenizer
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.state = TrainerState()
        self.callbacks = list(callbacks or [])
        self.loss_cfg = loss_config(cfg)
        self._setup_accelerator_and_model(model, ref_model)
        self._setup_rollout(scheduler, engine)
        self._setup_rewards(reward_funcs, reward_names, reward_weights)
        self._setup_outputs()

    # ------------------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------------------
    def train(self) -> TrainerState:
        self._maybe_resume()
        if getattr(self.engine, "engine_type", "") == "server":  # the server may hold other weights than --model
            self._sync_weights()
        self._call("on_train_begin")
        bar = self._progress_bar()
        try:
            while self.state.global_step < self.state.max_steps:
                micro_batches = self._next_window()  # rollout → rewards → advantages → logps, split
                self.state.windows += 1
                if self._train_on_window(micro_batches, bar):
                    self._sync_weights()
        except BaseException:
            bar.leave = False  # the error message, not a half-drawn bar, is the last thing on the terminal
            raise
        finally:
            bar.close()
            self._drain_async()
            self._log_file.close()
            self._completions_file.close()
        self._finish()
        return self.state

    def _next_window(self) -> list[RolloutBatch]:
        """The next window's micro-batches. With --async_generate the rollout of the window after it starts now,
        in a background thread, and overlaps with training on this one (it samples from weights one window
        old)."""
        if not self.async_generate:
            return self._prepare_inputs(self._next_prompts())
        if self._pending is None:
            self._pending = self._submit_rollout()
        future, prompts, submitted_at = self._pending
        t0 = time.perf_counter()
        rollout = future.result()
        wait = time.perf_counter() - t0
        self._pending = self._submit_rollout()
        micro_batches = self._prepare_inputs(prompts, rollout)
        self._window_metrics.update({"async/staleness": self.state.global_step - submitted_at,
                                     "async/wait_s": wait,
                                     "async/time_saved_s": max(0.0, rollout.timing["rollout"] - wait)})
        return micro_batches

    def _submit_rollout(self):
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpokit-rollout")
        prompts = self._next_prompts()
        return self._executor.submit(self._rollout_window, prompts), prompts, self.state.global_step

    def _drain_async(self) -> None:
        """Wait for a rollout still in flight (its prompts were never trained on; a checkpoint does not count
        them as consumed)."""
        if self._pending is not None:
            self._pending[0].exception()  # wait; an error there no longer matters
            self._pending = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _train_on_window(self, micro_batches: list[RolloutBatch], bar) -> bool:
        """num_iterations passes over the window's micro-batches; True when an optimizer step changed weights."""
        changed = False
        for _ in range(self.cfg.algorithm.num_iterations):
            for micro in micro_batches:
                self.training_step(self.model, micro)
                if self.accelerator.sync_gradients:
                    changed = True
                    self._on_optimizer_step(bar)
                if self.state.global_step >= self.state.max_steps:
                    return changed
        return changed

    def training_step(self, model, inputs: RolloutBatch) -> torch.Tensor:
        """One micro-step: loss, backward, and (every gradient_accumulation_steps) the optimizer step."""
        t0 = time.perf_counter()
        model.train()
        with self.accelerator.accumulate(model):
            with self.accelerator.autocast():
                loss, metrics = self._compute_loss_and_metrics(model, inputs)
            self.accelerator.backward(loss)
            if self.accelerator.sync_gradients and self.args.max_grad_norm > 0:
                grad_norm = self.accelerator.clip_grad_norm_(self._trainable_params, self.args.max_grad_norm)
                if grad_norm is not None:  # DeepSpeed clips inside its engine and may not report the norm
                    metrics["grad_norm"] = scalar(grad_norm)
            self.optimizer.step()
            if self.accelerator.sync_gradients:
                self.lr_scheduler.step()
            self.optimizer.zero_grad()
        metrics["loss"] = loss.detach()
        self._step_metrics.add(metrics)
        self._timing["train"] += time.perf_counter() - t0
        return loss.detach()

    # ------------------------------------------------------------------------------------------------------
    # forward and loss
    # ------------------------------------------------------------------------------------------------------
    def _prepare_model_inputs(self, inputs: RolloutBatch) -> dict:
        """Keyword arguments of ``model(**kwargs)``; override to feed extra inputs."""
        return {"input_ids": inputs.input_ids, "attention_mask": inputs.attention_mask,
                "position_ids": inputs.position_ids}

    def _get_per_token_logps_and_entropies(self, model, inputs: RolloutBatch, compute_entropy: bool = False):
        """The one entry for old, ref and current logps: forward, keep completion logits, divide by the sampling
        temperature, gather the sampled tokens' logprobs. Returns ([B, C] logps, [B, C] entropies or None)."""
        c = inputs.logits_to_keep
        kwargs = self._prepare_model_inputs(inputs)
        logits = completion_logits(model, logits_to_keep=c, share_prompts=self._share_prompts(model), **kwargs)
        logits = logits.float() / self.cfg.rollout.temperature  # [B, C, V] predicts the completion tokens
        targets = inputs.input_ids[:, -c:]
        logps = selective_log_softmax(logits, targets)
        entropies = None
        if compute_entropy:
            with torch.no_grad():
                entropies = entropy_from_logits(logits)
        return logps, entropies

    def _share_prompts(self, model) -> bool:
        """Compute each distinct prompt once (engines/prefix.py) where the model is called directly: not under
        DDP/FSDP/DeepSpeed wrappers (their hooks expect one forward per backward) or gradient checkpointing, and
        only for models big enough for it to pay off."""
        if self.accelerator.num_processes > 1 or self.args.deepspeed or self.args.fsdp:
            return False
        if id(model) not in self._worth_sharing:  # counted once per model: its parameters do not change
            self._worth_sharing[id(model)] = worth_sharing(model)
        if not self._worth_sharing[id(model)]:
            return False
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return not getattr(base, "is_activation_checkpointing", False)

    @torch.no_grad()
    def _batched_logps(self, model, batch: RolloutBatch) -> torch.Tensor:
        """Logps over a whole window in micro-batch-sized chunks (no grad), in batch row order."""
        out = torch.zeros_like(batch.completion_mask)
        b = self.args.per_device_train_batch_size
        for start in range(0, len(batch), b):
            chunk = batch.select(slice(start, start + b)).trim().to(self.accelerator.device)
            with self.accelerator.autocast():
                lp, _ = self._get_per_token_logps_and_entropies(model, chunk)
            out[start:start + b, : lp.shape[1]] = lp.float().cpu()
        return out

    def _compute_loss_and_metrics(self, model, inputs: RolloutBatch) -> tuple[torch.Tensor, dict]:
        a = self.cfg.algorithm
        inputs = inputs.to(self.accelerator.device)
        need_entropy = a.top_entropy_quantile < 1.0 or a.log_entropy
        logps, entropies = self._get_per_token_logps_and_entropies(model, inputs, compute_entropy=need_entropy)
        mask = loss_mask(inputs.completion_mask, inputs.truncated, a.overlong_filter)  # as _set_num_items counts
        metrics: dict = {}
        ent_mask = None
        if entropies is not None:
            if a.log_entropy:
                metrics["entropy"] = (entropies * mask).sum() / mask.sum().clamp(min=1)
            if a.top_entropy_quantile < 1.0:  # threshold over the global batch (ms-swift: mask keeps normaliser)
                ent_all = self._gather_cat(entropies[mask.bool()])
                thr = entropy_threshold(ent_all, torch.ones_like(ent_all), a.top_entropy_quantile)
                ent_mask = entropy_mask(entropies, mask, thr)
        old = inputs.old_logps if inputs.old_logps is not None else logps.detach()
        is_weights = None
        if a.rollout_importance_sampling_mode and inputs.rollout_logps is not None:
            rollout = torch.where(torch.isnan(inputs.rollout_logps), old, inputs.rollout_logps)
            is_out = rollout_importance_weights(old, rollout, mask, a.rollout_importance_sampling_mode,
                                                a.rollout_importance_sampling_threshold)
            is_weights = is_out.weights
            metrics.update(is_out.metrics)
        out = compute_policy_loss(
            LossInputs(logps=logps, old_logps=old, advantages=inputs.advantages, mask=mask,
                       ref_logps=inputs.ref_logps if self.loss_cfg.beta != 0 else None,
                       rollout_is_weights=is_weights, num_items=inputs.num_items, entropy_mask=ent_mask),
            self.loss_cfg,
        )
        metrics.update(out.metrics)
        return out.loss, metrics

    def _gather_cat(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate a 1-D tensor of any length over processes."""
        if self.accelerator.num_processes == 1:
            return t
        padded = self.accelerator.pad_across_processes(t.detach(), dim=0, pad_index=float("nan"))
        allv = self.accelerator.gather(padded)
        return allv[~torch.isnan(allv)]

    # ------------------------------------------------------------------------------------------------------
    # step bookkeeping
    # ------------------------------------------------------------------------------------------------------
    def _on_optimizer_step(self, bar) -> None:
        self.state.global_step += 1
        self._refresh_ref_model()
        step = self.state.global_step
        if step % self.args.logging_steps == 0 or step == self.state.max_steps:
            step_metrics = mean_over_processes(self.accelerator, self._step_metrics.pop())  # a collective
            logs = {**self._window_metrics, **step_metrics, **self._timing_metrics()}
            logs["learning_rate"] = self.lr_scheduler.get_last_lr()[0]
            logs = {"step": step, **{k: round(v, 6) if isinstance(v, float) else v for k, v in logs.items()}}
            self.state.last_logs = logs
            if self.accelerator.is_main_process:
                self._log_file.write(logs)
                self.accelerator.log({k: v for k, v in logs.items() if k != "step"}, step=step)
            self._call("on_log", logs)
            bar.set_postfix(reward=f"{logs.get('reward', math.nan):.3f}", loss=f"{logs.get('loss', math.nan):.4f}")
        if self.eval_dataset is not None and self.args.eval_steps and step % self.args.eval_steps == 0:
            self.evaluate()
        if step % self.args.save_steps == 0 and step < self.state.max_steps:
            self._save_checkpoint()
        bar.update(1)
        self._call("on_step_end")

    def _refresh_ref_model(self) -> None:
        a = self.cfg.algorithm
        if a.sync_ref_model and self.ref_model is not None and self.state.global_step % a.ref_model_sync_steps == 0:
            ema_update_(self.ref_model.parameters(), self.policy.parameters(), a.ref_model_mixup_alpha)

    def _call(self, event: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, event)(self, *args)
