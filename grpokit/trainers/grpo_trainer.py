"""GRPOTrainer: an explicit training loop over `accelerate`, composed of parts.

One rollout per window; the window's batch is reused for ``steps_per_generation × num_iterations`` micro-steps,
then thrown away (the seed's buffered ``_prepare_inputs``, here visible in ``train()``). The math lives in
``grpokit.algorithms``; the window comes from the buffer (group_buffer.py) and a ``WindowProducer``
(window_producer.py), output_dir belongs to ``RunOutputs`` (run_outputs.py). The set-up is ``setup_training``
(training_setup.py: the models) and ``TrainerSetup`` (trainer_setup.py: the rest), checkpoints and resume are
``TrainerCheckpoints`` (trainer_checkpoints.py). This class keeps the loop, the training step, the loss and the
optimizer step.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from functools import partial

import torch

from grpokit.aio import cancel_background_work
from grpokit.algorithms import ema_update_, loss_config
from grpokit.config.args import TrainConfig
from grpokit.config.plan import batch_plan, eval_due
from grpokit.distributed.offload import offload_context
from grpokit.distributed.processes import mean_over_processes, scalar
from grpokit.distributed.zero import grad_norm, is_engine, released_on_error
from grpokit.engines.sync_check import probe as sync_check
from grpokit.protocol import RolloutInferRequest, RolloutOutput
from grpokit.rollout.evaluate import EvalSettings, evaluate_policy
from grpokit.runs.outputs import MetricsAccumulator, progress_postfix
from grpokit.runs.stops import at_step_boundary
from grpokit.trainers import hooks
from grpokit.trainers.batch import RolloutBatch
from grpokit.trainers.chord_sft import sft_logps
from grpokit.trainers.forward import model_kwargs
from grpokit.trainers.policy_loss import needs_entropy, policy_loss
from grpokit.trainers.row_pieces import train_in_pieces
from grpokit.trainers.state import StepValues, TrainerState, WindowProgress
from grpokit.trainers.trainer_checkpoints import TrainerCheckpoints
from grpokit.trainers.trainer_setup import TrainerSetup
from grpokit.trainers.training_setup import setup_training
from grpokit.trainers.window import Window, WindowRollout


class GRPOTrainer(TrainerSetup, TrainerCheckpoints):
    """The GRPO training loop. A subclass may override the hooks of docs/plugins.md ("The hooks"), with the seed's
    signatures: ``_prepare_inputs``, ``_generate_completions``, ``_score_completions``, ``_prepare_batch_inputs``,
    ``_compute_advantages``, ``_prepare_model_inputs``, ``_get_per_token_logps_and_entropies``,
    ``_compute_loss_and_metrics`` and ``training_step``; other underscore methods are private. Public attributes
    (read by plugins and callbacks): ``cfg``, ``args``, ``plan``, ``loss_cfg``, ``state``, ``accelerator``,
    ``model``, ``policy``, ``optimizer``, ``lr_scheduler``, ``ref_model``, ``tokenizer``, ``template``, ``engine``,
    ``scheduler``, ``reward_names``, ``reward_runner``, ``callbacks``, ``output_dir``, ``process_group`` (the
    one-process group's lease, distributed/zero.py), and those ms-swift's code reads: ``temperature``,
    ``num_generations``, ``beta``, ``epsilon_low``, ``epsilon_high``, ``loss_type``."""

    def __init__(
        self,
        model,
        tokenizer,
        cfg: TrainConfig,
        train_dataset,
        eval_dataset=None,
        reward_funcs=None,
        reward_names=None,
        reward_weights=None,
        ref_model=None,
        scheduler=None,
        engine=None,
        callbacks=None,
        chord_sft_dataset=None,
        template=None,
        plan=None,
    ) -> None:
        hooks.check_subclass(type(self), GRPOTrainer)  # before anything loads: an ignored override is refused
        # template, plan: built once by the pipeline's set-up; made here for a trainer built in code
        self.cfg, self.args, self.plan, self.loss_cfg = cfg, cfg.training, plan or batch_plan(cfg), loss_config(cfg)
        self.tokenizer, self.eval_dataset = tokenizer, eval_dataset
        self.state = TrainerState()
        # the seed's names (ms-swift's meanings), read by ported trainer code
        self.temperature, self.num_generations = cfg.rollout.temperature, cfg.rollout.num_generations
        self.beta, self.loss_type = self.loss_cfg.beta, self.loss_cfg.loss_type
        self.epsilon_low, self.epsilon_high = self.loss_cfg.epsilon_low, self.loss_cfg.epsilon_high
        self.model = model  # until set-up wraps it: what an OptimizerCallback's create_optimizer reads
        parts = setup_training(
            model,
            ref_model,
            tokenizer,
            cfg,
            self.plan,
            len(train_dataset),
            engine is not None,
            owner=self,
            template=template,
        )
        self.process_group = parts.process_group  # released at the end of the run, or here if the set-up fails
        with released_on_error(self.process_group):
            self.accelerator, self.model, self.policy = parts.accelerator, parts.model, parts.policy
            self.optimizer, self.lr_scheduler, self.ref_model = parts.optimizer, parts.lr_scheduler, parts.ref_model
            self.template, self.state.max_steps = parts.template, parts.max_steps
            self._trainable_params = parts.trainable_params
            self._engine_steps = is_engine(self.model)  # DeepSpeed steps, accumulates, backward, norm: its own
            if self.accelerator.is_main_process:
                hooks.warn_sharded_grad_edit(type(self), GRPOTrainer, self.args)
            rewards = (reward_funcs, reward_names, reward_weights)
            self._set_up_rollout(GRPOTrainer, parts, train_dataset, engine, scheduler, rewards)
            self._set_up_run(GRPOTrainer, tokenizer, callbacks, chord_sft_dataset)
            self._hf_event("on_init_end")

    def _progress(self) -> dict:
        return {"global_step": self.state.global_step, "max_steps": self.state.max_steps}

    # -- the loop ------------------------------------------------------------------------------------------------------
    def train(self) -> TrainerState:
        """Windows until max_steps, then the final save. A run that raises gives its engine back at once (a rollout
        server's claim and weight group), not at the process's exit: in a notebook the trainer lives on."""
        try:
            return self._train()
        except BaseException:
            with contextlib.suppress(Exception):  # the run's own error is the one to see
                self.engine.close()
            raise

    def _train(self) -> TrainerState:
        step_metrics = MetricsAccumulator()  # the micro-steps' metrics until the next logging step
        resumed = self._resume(step_metrics)  # the rest of a window a checkpoint was taken inside, if any
        if getattr(self.engine, "engine_type", "") == "server":  # the server may hold other weights than --model
            self._sync_weights()
        self._call("on_train_begin")
        if self.args.eval_on_start and self.eval_dataset is not None and self.state.global_step == 0:
            self.evaluate()
        bar = self._outputs.progress(self.state.max_steps, self.state.global_step, self._producer.hooks.phases)
        sync_s = 0.0  # the weight sync that ended the previous window, reported with the next one
        self._stop.install()
        try:
            while self.state.global_step < self.state.max_steps and not self._callbacks.stop_requested():
                if resumed is None:
                    window = self._next_window()  # rollout → rewards → advantages → logps
                    self.state.windows += 1
                    progress = WindowProgress.of(
                        window.micro_batches(self.plan.steps_per_generation),
                        self.cfg.algorithm.num_iterations,
                        window.metrics,
                    )
                    timing = {**window.timing, "train": 0.0, "sync": sync_s}
                else:  # the saved micro-batches train first, then the next prompts are drawn
                    progress, resumed = resumed, None
                    timing = {"rollout": 0.0, "reward": 0.0, "logps": 0.0, "train": 0.0, "sync": sync_s}
                values = StepValues(progress.metrics, timing, step_metrics, progress)
                if self._train_on_window(values, bar):
                    sync_s = self._sync_weights()
        except BaseException:
            bar.leave = False  # the error message, not a half-drawn bar, is the last thing on the terminal
            cancel_background_work()  # a --max_staleness rollout nobody will train on: drained below, not awaited
            self.process_group.release()  # a one-process group (--deepspeed/--fsdp): no peer to wait for
            raise
        finally:
            self._stop.restore()
            bar.close()
            self._async.drain()
            self._producer.prompts.close()  # its read-ahead workers end with the loop, not with the process
            self._outputs.close()
        self._finish()
        return self.state

    @at_step_boundary  # an error here saves the last optimizer step first (runs/stops.py)
    def _next_window(self) -> Window:
        """The next window from the buffer: rolled out ahead with --max_staleness (its async metrics added), or
        drawn here and rolled out by ``_prepare_inputs`` (K = 0)."""
        prompts, rollout, async_metrics = self._async.next(self.state.global_step)
        window = self._prepare_inputs(prompts, rollout)
        window.metrics = {**window.metrics, **async_metrics}
        self.state.prompts_consumed = self._producer.prompts.position
        self.state.epoch = self.state.prompts_consumed / max(1, len(self._producer.prompts.dataset))
        self._outputs.write_completions(window.completion_rows)
        return window

    def _train_on_window(self, values: StepValues, bar) -> bool:
        """num_iterations passes over the window's untrained micro-batches (``values.window``); True when an
        optimizer step changed weights. As in HF Trainer, the optimizer step comes after ``training_step`` returns,
        so a gradient edit in an override on the synchronising micro-step reaches the optimizer."""
        changed, step_begins = False, True
        for micro in values.window.remaining():
            t0 = time.perf_counter()
            micro = replace(micro, step_metrics={})  # this micro-step's loss metrics come back in it
            with self.accelerator.accumulate(*(() if self._engine_steps else (self.model,))):  # DeepSpeed: itself
                if step_begins:
                    self._hf_event("on_step_begin")
                self.training_step(self.model, micro, *([micro.num_items] if self._step_takes_num_items else []))
            synced = step_begins = self.accelerator.sync_gradients  # the next micro-step starts a new step
            values.step_metrics.add({**micro.step_metrics, **self._optimizer_step(micro.step_metrics.get("loss"))})
            values.timing["train"] += time.perf_counter() - t0
            if synced:
                changed = True
                self._on_optimizer_step(bar, values)
                if self._callbacks.stop_requested():
                    return changed
            else:
                self._hf_event("on_substep_end")
            if self.state.global_step >= self.state.max_steps:
                return changed
        return changed

    def training_step(self, model, inputs: RolloutBatch, num_items_in_batch=None) -> torch.Tensor:
        """One micro-step: the loss and its backward, nothing more (HF's contract: it returns once backward is
        done; the loop clips and steps the optimizer after it). ``num_items_in_batch``: the loss denominator of
        dapo/cispo/vespo (``inputs['num_items_in_batch']``), when given."""
        model.train()
        if num_items_in_batch is not None:
            inputs.num_items = num_items_in_batch
        if len(inputs) > self.args.per_device_train_batch_size and not self._engine_steps:
            loss, metrics = train_in_pieces(self, model, inputs)  # an oversized window: pieces of the configured size
        else:
            with self.accelerator.autocast():
                loss, metrics = self._loss_call(model, inputs)
            (model.backward if self._engine_steps else self.accelerator.backward)(loss)  # DeepSpeed: engine.backward
            loss = loss.detach()
        inputs.step_metrics.update(metrics)
        inputs.step_metrics["loss"] = loss
        return loss

    def _optimizer_step(self, loss: torch.Tensor | None) -> dict:
        """After ``training_step`` returned, on the synchronising micro-step: clip (grad_norm), step (skipped on a
        NaN/inf ``loss`` or grad norm: trainers/state.py), advance the schedule, zero the gradients. A DeepSpeed engine
        steps on every micro-step (it counts them, and reduces, clips and steps at its boundary)."""
        metrics: dict = {}
        if not self.accelerator.sync_gradients:
            if self._engine_steps:
                self.optimizer.step()
            return metrics
        self._hf_event("on_pre_optimizer_step")
        # no parameters to clip under --deepspeed: its engine clips in optimizer.step()
        clip = self.args.max_grad_norm > 0 and self._trainable_params
        norm = self.accelerator.clip_grad_norm_(self._trainable_params, self.args.max_grad_norm) if clip else None
        if norm is not None:
            metrics["grad_norm"] = scalar(norm)
        if self._step_guard.allow_step(
            self.accelerator, loss, norm, step=self.state.global_step + 1, params=self._trainable_params
        ):
            self.optimizer.step()
        self._hf_event("on_optimizer_step")
        self.lr_scheduler.step()
        if self._engine_steps and (engine_norm := grad_norm(self.optimizer)) is not None:  # DeepSpeed's, its step
            metrics["grad_norm"] = engine_norm
        self.optimizer.zero_grad()
        return metrics

    # -- the window (hooks) --------------------------------------------------------------------------------------------
    def _prepare_inputs(self, prompts: list[dict], rollout: WindowRollout | None = None) -> Window:
        """One window: its rollout (or the one --async_generate made ahead), rewards, advantages, tensors."""
        rollout = rollout or self._producer.rollout(prompts)
        return self._producer.build(rollout, step=self.state.global_step)

    def _generate_completions(self, requests: list[RolloutInferRequest]) -> list[RolloutOutput]:
        """Trajectories for the requests, through the scheduler (which drives the engine or a rollout client)."""
        return self._producer.generate(requests)

    def _score_completions(self, requests: list[RolloutInferRequest], outputs: list[RolloutOutput]) -> torch.Tensor:
        """[N, F] rewards (NaN = not scored) from every reward function and model; gym rewards as a last column."""
        return self._producer.score(requests, outputs, self._progress())

    def _prepare_batch_inputs(self, inputs: list[dict]) -> list[RolloutBatch]:
        """The window's rows (one dict per trajectory, ``window.sample_rows``) encoded, with old/ref logps where
        the loss needs them, cut into ``steps_per_generation`` mini-batches (the seed's mini-batch dicts, at the
        window's width). Override to add keys: ``batch['my_key'] = tensor`` (one row each) reaches the loss."""
        return self._producer.encode_rows(inputs).chunks(self.plan.steps_per_generation)

    def _compute_advantages(
        self, inputs: list[dict], rewards_per_func: torch.Tensor, batch_encoded_inputs: list[RolloutBatch]
    ) -> torch.Tensor:
        """[N_global] advantages from ``rewards_per_func`` [N_global, F] (every process's rows, gathered) with the
        --advantage_estimator and --scale_rewards registries; ``inputs`` are this process's rows,
        ``batch_encoded_inputs`` its mini-batches (their old/ref logps give the --kl_in_reward penalty)."""
        joined = RolloutBatch.join(batch_encoded_inputs, len(inputs), "batch_encoded_inputs")
        return self._producer.estimate(inputs, rewards_per_func, joined).advantages

    # -- forward and loss (hooks) --------------------------------------------------------------------------------------
    def _prepare_model_inputs(self, inputs: RolloutBatch) -> dict:
        """Keyword arguments of ``model(**kwargs)``; override to feed extra inputs (forward.model_kwargs)."""
        return model_kwargs(inputs, self._logps.pixel_dtype)

    def _get_per_token_logps_and_entropies(self, model, inputs: RolloutBatch, compute_entropy: bool = False):
        """The one entry for old, ref and current logps: forward, then from the positions that predict the
        completion, logits / temperature and the sampled tokens' logprobs (chunked in the output head's place,
        or from full logits: trainers/packing.py). Returns ([B, C] logps, [B, C] entropies or None)."""
        return self._logps(model, inputs, compute_entropy, self._prepare_model_inputs(inputs))

    def _compute_loss_and_metrics(
        self, model, inputs: RolloutBatch, grpo_batch: RolloutBatch | None = None
    ) -> tuple[torch.Tensor, dict]:
        """The policy loss of one micro-batch and its metrics. Called ``(model, inputs)`` (the seed's), or
        ``(model, model_inputs, grpo_batch)`` by an override in ms-swift 4.6's shape: there both are the batch
        (``model_inputs['input_ids']``, ``grpo_batch.completion_mask`` ...), and the forward's keyword arguments
        come from ``_prepare_model_inputs``."""
        inputs = (inputs if grpo_batch is None else hooks.loss_batch(inputs, grpo_batch)).to(self.accelerator.device)
        need = needs_entropy(self.cfg.algorithm)
        logps, entropies = self._get_per_token_logps_and_entropies(model, inputs, compute_entropy=need)
        loss, metrics = policy_loss(logps, entropies, inputs, self.cfg.algorithm, self.loss_cfg, self.accelerator)
        if self._chord is None:
            return loss, metrics
        loss, chord_metrics = self._chord.mix(
            loss,
            self.state.global_step,
            partial(
                sft_logps,
                model,
                device=self.accelerator.device,
                model_kwargs=self._prepare_model_inputs,
                chunk_size=self.args.logps_chunk_size,
                padding_free=self.args.padding_free,
            ),
        )
        return loss, {**metrics, **chord_metrics}

    # -- step bookkeeping ----------------------------------------------------------------------------------------------
    def _on_optimizer_step(self, bar, values: StepValues) -> None:
        """Step bookkeeping: the reference model's EMA, then (HF's order) on_step_end, the log, evaluation and the
        checkpoint, each at its interval or when a transformers callback asked for it through ``control``."""
        self.state.global_step += 1
        step, a = self.state.global_step, self.cfg.algorithm
        if a.sync_ref_model and self.ref_model is not None and step % a.ref_model_sync_steps == 0:  # EMA reference
            ema_update_(self.ref_model.parameters(), self.policy.parameters(), a.ref_model_mixup_alpha)
        self._hf_event("on_step_end")
        control = self._callbacks.control
        first = step == 1 and self.args.logging_first_step
        if (
            step % self.args.logging_steps == 0
            or step == self.state.max_steps
            or first
            or (control is not None and (control.should_log or control.should_training_stop))
        ):
            step_metrics = mean_over_processes(self.accelerator, values.step_metrics.pop())  # a collective
            logs = values.log_row(step, step_metrics, self.lr_scheduler.get_last_lr()[0])
            self.state.last_logs = logs
            self.state.log_history.append({**logs, "epoch": round(self.state.epoch, 4)})
            self._outputs.log(logs)
            self._call("on_log", logs)
            bar.set_postfix(**progress_postfix(logs))
        if self.eval_dataset is not None and (
            eval_due(self.args, step, self.state.max_steps) or (control is not None and control.should_evaluate)
        ):
            self.evaluate()
        every, saved = self.args.save_strategy == "steps" and step % self.args.save_steps == 0, None
        asked = control is not None and control.should_save
        if (every or asked) and step < self.state.max_steps and not self._callbacks.stop_requested():
            saved = self._save_checkpoint(values)  # (the last step's checkpoint is the final one, saved by _finish)
        bar.update(1)
        self._call("on_step_end")
        self._callbacks.new_step()
        if step < self.state.max_steps and (signum := self._stop.agreed(self.accelerator)):
            raise self._stop.stopped(signum, step, saved or self._save_checkpoint(values))

    @at_step_boundary
    def _sync_weights(self) -> float:
        """The engine's weights from the policy; returns the seconds it took."""
        t0 = time.perf_counter()
        sync_check.sync(self.engine, self.policy, self.cfg.rollout, self.state.global_step, self.template)
        if self.accelerator.num_processes > 1:  # rank 0 pushes to a rollout server; the others must not sample
            self.accelerator.wait_for_everyone()  # from it before the push is done
        self._producer.weights_at = self.state.global_step  # the version the next rollouts are tagged with
        return time.perf_counter() - t0

    def _call(self, event: str, *args) -> None:
        self._callbacks.call(event, self, *args)

    def _hf_event(self, event: str, **kwargs) -> None:
        self._callbacks.hf_event(event, self, **kwargs)

    # -- evaluation, the end (checkpoints: trainer_checkpoints.py) ------------------------------------------------
    def evaluate(self) -> dict:
        """Greedy and (--num_generations_eval) sampled completions of the validation set, scored (evaluate.py)."""
        rows = [self.eval_dataset[i] for i in range(len(self.eval_dataset))]
        with offload_context(self._producer.offloader):  # evaluation generates too
            result = evaluate_policy(
                self.engine,
                self.template,
                rows,
                self.reward_runner,
                self.reward_names,
                EvalSettings.for_run(self.cfg),
                trainer_state=self._progress(),
            )
        logs = {"step": self.state.global_step, **{f"eval/{k}": v for k, v in result.metrics.items()}}
        self._outputs.log_eval(logs)
        self._hf_event("on_evaluate", metrics=logs)
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
        self.process_group.release()  # the one-process group of --deepspeed without a launcher, and its variables
        self.accelerator.end_training()
