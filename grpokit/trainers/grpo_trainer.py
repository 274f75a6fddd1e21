"""GRPOTrainer: an explicit training loop over `accelerate`, composed of parts.

One rollout per window; the window's batch is reused for ``steps_per_generation × num_iterations`` micro-steps,
then thrown away (the seed's buffered ``_prepare_inputs``, here visible in ``train()``). The math lives in
``grpokit.algorithms``; the window comes from a ``WindowProducer`` (window_producer.py), output_dir belongs to
``RunOutputs`` (run_outputs.py), the set-up is ``setup_training`` (training_setup.py). This class keeps the loop,
the training step, the loss and the optimizer step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from grpokit.algorithms import (
    LossInputs,
    compute_policy_loss,
    ema_update_,
    entropy_mask,
    entropy_threshold,
    loss_mask,
    rollout_importance_weights,
)
from grpokit.config.args import TrainConfig
from grpokit.config.plan import batch_plan
from grpokit.config.validate import loss_config
from grpokit.engines.prefix import worth_sharing
from grpokit.protocol import RolloutInferRequest, RolloutOutput
from grpokit.rollout.evaluate import evaluate_rows
from grpokit.template.processor import collate_mm
from grpokit.trainers.batch import RolloutBatch
from grpokit.trainers.chord_sft import ChordSFT
from grpokit.trainers.distributed import gather_cat, mean_over_processes, scalar
from grpokit.trainers.offload import make_offloader, offload_context
from grpokit.trainers.outputs import MetricsAccumulator
from grpokit.trainers.packing import ForwardOptions, completion_logps
from grpokit.trainers.prompts import PromptStream
from grpokit.trainers.run_outputs import RunOutputs
from grpokit.trainers.training_setup import setup_rewards, setup_rollout, setup_training
from grpokit.trainers.window import Window, WindowRollout
from grpokit.trainers.window_producer import AsyncWindows, Models, WindowProducer
from grpokit.trainers.zero import backward, grad_norm, release_process_group, synced_models


@dataclass
class TrainerState:
    global_step: int = 0  # optimizer steps done
    max_steps: int = 0
    prompts_consumed: int = 0  # position in the prompt stream (resumable)
    windows: int = 0
    last_logs: dict = field(default_factory=dict)


class GRPOTrainer:
    """The GRPO training loop. Subclasses may override these hooks (docs/plugins.md shows each with an example):
    ``_prepare_inputs(prompts, rollout=None) -> Window``, ``_generate_completions(requests)``,
    ``_score_completions(requests, outputs)``, ``_prepare_model_inputs(inputs)``,
    ``_get_per_token_logps_and_entropies(model, inputs, compute_entropy=False)``,
    ``_compute_loss_and_metrics(model, inputs)`` and ``training_step(model, inputs)``. Every other underscore
    method is private and may change.

    Public attributes, set in ``__init__`` and read by plugins and callbacks: ``cfg`` (the whole TrainConfig),
    ``args`` (its training options), ``plan`` (BatchPlan), ``loss_cfg``, ``state`` (TrainerState),
    ``accelerator``, ``model`` (as prepared by accelerate), ``policy`` (the model inside any wrapper),
    ``optimizer``, ``lr_scheduler``, ``ref_model`` (None with LoRA or beta 0), ``tokenizer``, ``template``,
    ``engine``, ``scheduler``, ``reward_names``, ``reward_runner``, ``callbacks``, ``output_dir``.
    """

    def __init__(self, model, tokenizer, cfg: TrainConfig, train_dataset, eval_dataset=None, reward_funcs=None,
                 reward_names=None, reward_weights=None, ref_model=None, scheduler=None, engine=None,
                 callbacks=None, chord_sft_dataset=None) -> None:
        self.cfg, self.args, self.plan, self.loss_cfg = cfg, cfg.training, batch_plan(cfg), loss_config(cfg)
        self.tokenizer = tokenizer
        self.eval_dataset = eval_dataset
        self.state = TrainerState()
        self.callbacks = list(callbacks or [])
        parts = setup_training(model, ref_model, tokenizer, cfg, self.plan, len(train_dataset), engine is not None)
        self.accelerator, self.model, self.policy = parts.accelerator, parts.model, parts.policy
        self.optimizer, self.lr_scheduler, self.ref_model = parts.optimizer, parts.lr_scheduler, parts.ref_model
        self.template, self.state.max_steps = parts.template, parts.max_steps
        self._trainable_params = parts.trainable_params
        self.engine, self.scheduler = setup_rollout(engine, scheduler, self.policy, self.template, cfg,
                                                    self.accelerator, parts.generation_model)
        # --offload_model/--offload_optimizer: out to CPU memory while an engine with its own weights generates
        self._offloader = make_offloader(cfg.rollout, self.engine, [self.policy, self.ref_model], self.optimizer,
                                         self.accelerator.device, self.accelerator.is_main_process)
        rewards = setup_rewards(reward_funcs, reward_names, reward_weights, self.scheduler)
        self.reward_names, self.reward_runner = rewards.names, rewards.runner
        prompts = PromptStream(train_dataset, self.plan.prompts_per_rollout, seed=self.args.seed,
                               shuffle=cfg.data.dataset_shuffle, num_processes=self.accelerator.num_processes,
                               process_index=self.accelerator.process_index,
                               num_workers=self.args.dataloader_num_workers or 0,
                               prefetch_factor=self.args.dataloader_prefetch_factor,
                               multiprocessing_context=self.args.dataloader_multiprocessing_context)
        self._producer = WindowProducer(
            self, prompts, scheduler=self.scheduler, template=self.template, rewards=rewards,
            models=Models(self.model, self.policy, self.ref_model, self.args.per_device_train_batch_size),
            accelerator=self.accelerator, rollout_args=cfg.rollout, algorithm=cfg.algorithm, plan=self.plan,
            log_completions=self.args.log_completions, offloader=self._offloader)
        self._async = AsyncWindows(self._producer) if cfg.rollout.async_generate else None
        # CHORD (--chord_sft_dataset): an SFT term on expert rows mixed into each micro-batch's loss
        self._chord = None if chord_sft_dataset is None else ChordSFT(
            chord_sft_dataset, self.template, cfg, num_processes=self.accelerator.num_processes,
            process_index=self.accelerator.process_index)
        self._outputs = RunOutputs(self.accelerator, self.args, cfg.flat(), tokenizer)
        self.output_dir = self._outputs.output_dir
        self._step_metrics = MetricsAccumulator()
        self._window_metrics: dict = {}
        self._timing = {"rollout": 0.0, "reward": 0.0, "logps": 0.0, "train": 0.0}
        self._last_sync_s = 0.0
        self._worth_sharing: dict[int, bool] = {}  # id(model) → whether prompt sharing pays off

    # ------------------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------------------
    def train(self) -> TrainerState:
        self._resume()
        if getattr(self.engine, "engine_type", "") == "server":  # the server may hold other weights than --model
            self._sync_weights()
        self._call("on_train_begin")
        if self.args.eval_on_start and self.eval_dataset is not None and self.state.global_step == 0:
            self.evaluate()
        bar = self._outputs.progress(self.state.max_steps, self.state.global_step)
        try:
            while self.state.global_step < self.state.max_steps:
                micro_batches = self._next_window()  # rollout → rewards → advantages → logps, split
                self.state.windows += 1
                if self._train_on_window(micro_batches, bar):
                    self._sync_weights()
        except BaseException:
            bar.leave = False  # the error message, not a half-drawn bar, is the last thing on the terminal
            release_process_group()  # a one-process DeepSpeed group: no peer to wait for
            raise
        finally:
            bar.close()
            if self._async is not None:
                self._async.drain()
            self._outputs.close()
        self._finish()
        return self.state

    def _next_window(self) -> list[RolloutBatch]:
        """The next window's micro-batches. With --async_generate its rollout was started while the previous
        window trained, and the rollout of the window after it starts now."""
        if self._async is None:
            window, async_metrics = self._prepare_inputs(self._producer.prompts.next()), {}
        else:
            prompts, rollout, async_metrics = self._async.next(self.state.global_step)
            window = self._prepare_inputs(prompts, rollout)
        self.state.prompts_consumed = self._producer.prompts.position
        # the weight sync that ended the previous window is reported with this one
        self._timing = {"logps": window.timing["logps"], "train": 0.0, "rollout": window.timing["rollout"],
                        "reward": window.timing["reward"], "sync": self._last_sync_s}
        self._window_metrics = {**window.metrics, **async_metrics}
        self._outputs.write_completions(window.completion_rows)
        return window.micro_batches(self.plan.steps_per_generation)

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
        with self.accelerator.accumulate(*synced_models(model)):  # a DeepSpeed engine accumulates itself
            with self.accelerator.autocast():
                loss, metrics = self._compute_loss_and_metrics(model, inputs)
            backward(self.accelerator, model, loss)
            # no parameters to clip under --deepspeed: its engine clips in optimizer.step()
            if self.accelerator.sync_gradients and self.args.max_grad_norm > 0 and self._trainable_params:
                norm = self.accelerator.clip_grad_norm_(self._trainable_params, self.args.max_grad_norm)
                if norm is not None:
                    metrics["grad_norm"] = scalar(norm)
            self.optimizer.step()
            if self.accelerator.sync_gradients:
                self.lr_scheduler.step()
                if (engine_norm := grad_norm(self.optimizer)) is not None:  # DeepSpeed's, from its step
                    metrics["grad_norm"] = engine_norm
            self.optimizer.zero_grad()
        metrics["loss"] = loss.detach()
        self._step_metrics.add(metrics)
        self._timing["train"] += time.perf_counter() - t0
        return loss.detach()

    # ------------------------------------------------------------------------------------------------------
    # the window (hooks)
    # ------------------------------------------------------------------------------------------------------
    def _prepare_inputs(self, prompts: list[dict], rollout: WindowRollout | None = None) -> Window:
        """One window: its rollout (or the one --async_generate made ahead), rewards, advantages, tensors."""
        rollout = rollout or self._producer.rollout(prompts)
        return self._producer.build(rollout, step=self.state.global_step)

    def _generate_completions(self, requests: list[RolloutInferRequest]) -> list[RolloutOutput]:
        """Trajectories for the requests, through the scheduler (which drives the engine or a rollout client)."""
        return self._producer.generate(requests)

    def _score_completions(self, requests: list[RolloutInferRequest], outputs: list[RolloutOutput]) -> torch.Tensor:
        """[N, F] rewards (NaN = not scored) from every reward function and model; gym rewards as a last column."""
        return self._producer.score(requests, outputs, {"global_step": self.state.global_step,
                                                        "max_steps": self.state.max_steps})

    # ------------------------------------------------------------------------------------------------------
    # forward and loss (hooks)
    # ------------------------------------------------------------------------------------------------------
    def _prepare_model_inputs(self, inputs: RolloutBatch) -> dict:
        """Keyword arguments of ``model(**kwargs)``; override to feed extra inputs. A vision-language batch adds
        its rows' processor tensors (template/processor.py) and leaves positions to the model (Qwen-VL's are 3-D)."""
        if inputs.mm_inputs is not None:
            c = inputs.logits_to_keep
            mm = collate_mm(inputs.mm_inputs, inputs.input_ids.shape[1] - c, c)
            mm = {k: v.to(inputs.input_ids.device) for k, v in mm.items()}
            if "pixel_values" in mm:
                mm["pixel_values"] = mm["pixel_values"].to(next(self.policy.parameters()).dtype)
            return {"input_ids": inputs.input_ids, "attention_mask": inputs.attention_mask, "position_ids": None,
                    **mm}
        return {"input_ids": inputs.input_ids, "attention_mask": inputs.attention_mask,
                "position_ids": inputs.position_ids}

    def _get_per_token_logps_and_entropies(self, model, inputs: RolloutBatch, compute_entropy: bool = False):
        """The one entry for old, ref and current logps: forward, and from the positions that predict the
        completion tokens, logits divided by the sampling temperature, the sampled tokens' logprobs (chunked in
        the output head's place, or from full logits: trainers/packing.py). Returns ([B, C] logps, [B, C]
        entropies or None)."""
        opts = ForwardOptions(temperature=self.cfg.rollout.temperature, chunk_size=self.args.logps_chunk_size,
                              padding_free=self.args.padding_free, share_prompts=self._share_prompts(model))
        return completion_logps(model, self._prepare_model_inputs(inputs), inputs.logits_to_keep, opts,
                                compute_entropy)

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

    def _compute_loss_and_metrics(self, model, inputs: RolloutBatch) -> tuple[torch.Tensor, dict]:
        a = self.cfg.algorithm
        inputs = inputs.to(self.accelerator.device)
        need_entropy = a.top_entropy_quantile < 1.0 or a.log_entropy
        logps, entropies = self._get_per_token_logps_and_entropies(model, inputs, compute_entropy=need_entropy)
        mask = loss_mask(inputs.completion_mask, inputs.truncated, a.overlong_filter)  # as window_num_items counts
        metrics: dict = {}
        ent_mask = None
        if entropies is not None:
            if a.log_entropy:
                metrics["entropy"] = (entropies * mask).sum() / mask.sum().clamp(min=1)
            if a.top_entropy_quantile < 1.0:  # threshold over the global batch (ms-swift: mask keeps normaliser)
                ent_all = gather_cat(self.accelerator, entropies[mask.bool()])
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
        if self._chord is None:
            return out.loss, metrics
        loss, chord_metrics = self._chord.mix(out.loss, self.state.global_step, lambda b: self._sft_logps(model, b))
        return loss, {**metrics, **chord_metrics}

    def _sft_logps(self, model, batch: RolloutBatch) -> torch.Tensor:
        """CHORD: the expert reply tokens' logps, from plain logits (temperature 1, as an SFT loss takes them)."""
        batch = batch.to(self.accelerator.device)
        opts = ForwardOptions(temperature=1.0, chunk_size=self.args.logps_chunk_size,
                              padding_free=self.args.padding_free, share_prompts=False)
        return completion_logps(model, self._prepare_model_inputs(batch), batch.logits_to_keep, opts)[0]

    # ------------------------------------------------------------------------------------------------------
    # step bookkeeping
    # ------------------------------------------------------------------------------------------------------
    def _on_optimizer_step(self, bar) -> None:
        self.state.global_step += 1
        self._refresh_ref_model()
        step = self.state.global_step
        first = step == 1 and self.args.logging_first_step
        if step % self.args.logging_steps == 0 or step == self.state.max_steps or first:
            step_metrics = mean_over_processes(self.accelerator, self._step_metrics.pop())  # a collective
            logs = {**self._window_metrics, **step_metrics,
                    **{f"timing/{k}": round(v, 4) for k, v in self._timing.items()}}
            logs["learning_rate"] = self.lr_scheduler.get_last_lr()[0]
            logs = {"step": step, **{k: round(v, 6) if isinstance(v, float) else v for k, v in logs.items()}}
            self.state.last_logs = logs
            self._outputs.log(logs)
            self._call("on_log", logs)
            chord = {"mu": f"{logs['chord/mu']:.3f}", "sft_loss": f"{logs['chord/sft_loss']:.4f}"} \
                if "chord/mu" in logs else {}
            bar.set_postfix(reward=f"{logs.get('reward', math.nan):.3f}", loss=f"{logs.get('loss', math.nan):.4f}",
                            **chord)
        if self.eval_dataset is not None and self.args.eval_steps and step % self.args.eval_steps == 0:
            self.evaluate()
        if self.args.save_strategy == "steps" and step % self.args.save_steps == 0 and step < self.state.max_steps:
            self._save_checkpoint()
        bar.update(1)
        self._call("on_step_end")

    def _refresh_ref_model(self) -> None:
        a = self.cfg.algorithm
        if a.sync_ref_model and self.ref_model is not None and self.state.global_step % a.ref_model_sync_steps == 0:
            ema_update_(self.ref_model.parameters(), self.policy.parameters(), a.ref_model_mixup_alpha)

    def _sync_weights(self) -> None:
        t0 = time.perf_counter()
        self.engine.sync_weights(self.policy)
        if self.accelerator.num_processes > 1:  # rank 0 pushes to a rollout server; the others must not sample
            self.accelerator.wait_for_everyone()  # from it before the push is done
        self._last_sync_s = time.perf_counter() - t0

    def _call(self, event: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, event)(self, *args)

    # ------------------------------------------------------------------------------------------------------
    # checkpoints, evaluation, the end
    # ------------------------------------------------------------------------------------------------------
    def _save_checkpoint(self):
        in_flight = self.plan.prompts_per_rollout if self._async and self._async.in_flight else 0  # not trained on
        chord = {} if self._chord is None else {"chord_sft_consumed": self._chord.position}
        ckpt = self._outputs.save_checkpoint(self.model, step=self.state.global_step, max_steps=self.state.max_steps,
                                             prompts_consumed=self.state.prompts_consumed - in_flight, extra=chord)
        self._call("on_save", str(ckpt))
        return ckpt

    def _resume(self) -> None:
        loop = self._outputs.resume()
        if loop is None:
            return
        self.state.global_step = loop["global_step"]
        self.state.prompts_consumed = self._producer.prompts.position = loop["prompts_consumed"]
        if self._chord is not None:  # mu follows global_step; the SFT rows continue where the checkpoint left
            self._chord.position = loop.get("chord_sft_consumed", 0)
        self.engine.sync_weights(self.policy)

    def evaluate(self) -> dict:
        """Greedy completions on the validation set, scored with the reward functions."""
        rows = [self.eval_dataset[i] for i in range(len(self.eval_dataset))]
        with offload_context(self._offloader):  # evaluation generates too
            result = evaluate_rows(self.engine, self.template, rows, self.reward_runner, self.reward_names,
                                   max_tokens=self.cfg.rollout.max_completion_length,
                                   batch_size=self.args.per_device_eval_batch_size,
                                   trainer_state={"global_step": self.state.global_step,
                                                  "max_steps": self.state.max_steps})
        logs = {"step": self.state.global_step, **{f"eval/{k}": v for k, v in result.metrics.items()}}
        self._outputs.log_eval(logs)
        return logs

    def _finish(self) -> None:
        self.accelerator.wait_for_everyone()
        final_ckpt = self._save_checkpoint()
        self._outputs.finish(self.model, final_ckpt)
        self._call("on_train_end")
        self.engine.close()
        if self.reward_runner is not None:
            self.reward_runner.close()
        self.accelerator.wait_for_everyone()  # no rank tears the process group down while another still uses it
        release_process_group()  # the one-process group of --deepspeed without a launcher, and its variables
        self.accelerator.end_training()
