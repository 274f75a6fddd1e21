"""GRPOTrainer's set-up past the models (training_setup.py builds those): the rollout side (engine and
scheduler, offloading, rewards, the prompt stream, the logps function, the window producer and the buffer of
asynchronous training), then the run's outputs, callbacks and step guards. The trainer's ``__init__`` calls
these in order; the loop and the step are the trainer's own (grpo_trainer.py)."""

from __future__ import annotations

from grpokit.distributed.offload import make_offloader
from grpokit.runs.outputs import completion_limits
from grpokit.runs.run_outputs import RunOutputs
from grpokit.runs.stops import StopRequest
from grpokit.trainers import hooks
from grpokit.trainers.chord_sft import ChordSFT
from grpokit.trainers.forward import Logps, prompt_sharing
from grpokit.trainers.group_buffer import buffer_for_run
from grpokit.trainers.hf_callbacks import RunCallbacks
from grpokit.trainers.prompts import PromptStream
from grpokit.trainers.state import StepGuard
from grpokit.trainers.training_setup import setup_rewards, setup_rollout
from grpokit.trainers.window_producer import Models, WindowProducer


class TrainerSetup:
    """The parts of a GRPOTrainer that its ``__init__`` adds once the models are built."""

    def _set_up_rollout(self, base: type, parts, train_dataset, engine, scheduler, rewards: tuple) -> None:
        """The engine and scheduler, offloading, rewards (``rewards``: reward_funcs, reward_names,
        reward_weights), the prompt stream, the logps function, the window producer and the buffer."""
        cfg, acc = self.cfg, self.accelerator
        columns = getattr(train_dataset, "column_names", ())
        images = getattr(self.template, "multimodal", False) or "images" in columns
        self.engine, self.scheduler = setup_rollout(
            engine, scheduler, self.policy, self.template, cfg, acc, parts.generation_model, images
        )
        # --offload_model/--offload_optimizer: out to CPU memory while an engine with its own weights generates
        models = [self.policy, self.ref_model]
        offloader = make_offloader(cfg.rollout, self.engine, models, self.optimizer, acc.device, acc.is_main_process)
        distill = parts.teachers is not None
        reward_set = setup_rewards(*rewards, self.scheduler, timeout=cfg.reward.reward_timeout, distill=distill)
        self.reward_names, self.reward_runner = reward_set.names, reward_set.runner
        shuffle, by_group = cfg.data.dataset_shuffle, cfg.rollout.stream_groups
        prompts = PromptStream.for_run(train_dataset, self.plan.prompts_per_rollout, self.args, shuffle, acc, by_group)
        # decided once: which models' forwards share prompts (forward.py); the pixel dtype of image inputs
        distributed = acc.num_processes > 1 or bool(self.args.deepspeed or self.args.fsdp)
        self._logps = Logps(
            temperature=self.temperature,
            chunk_size=self.args.logps_chunk_size,
            padding_free=self.args.padding_free,
            pixel_dtype=next(self.policy.parameters()).dtype,
            sharing=prompt_sharing([self.model, self.ref_model], distributed=distributed),
        )
        micro = self.args.per_device_train_batch_size  # teachers: on-policy distillation (trainers/teachers.py)
        self._producer = WindowProducer(
            hooks.window_hooks(self, base, self._logps),
            prompts,
            scheduler=self.scheduler,
            template=self.template,
            rewards=reward_set,
            accelerator=acc,
            rollout_args=cfg.rollout,
            algorithm=cfg.algorithm,
            models=Models(self.model, self.policy, self.ref_model, micro, parts.teachers),
            plan=self.plan,
            log_completions=completion_limits(self.args),
            offloader=offloader,
            images=images,
        )
        self._async = buffer_for_run(self._producer, cfg.rollout, self.plan)  # --max_staleness, K = 0 included

    def _set_up_run(self, base: type, tokenizer, callbacks, chord_sft_dataset) -> None:
        """CHORD, the run's outputs, the hooks' calling conventions, callbacks, step guard and stop request."""
        cfg, acc = self.cfg, self.accelerator
        self._chord = None  # CHORD: an SFT term mixed into the loss
        if chord_sft_dataset is not None:
            where = {"num_processes": acc.num_processes, "process_index": acc.process_index}
            self._chord = ChordSFT(chord_sft_dataset, self.template, cfg, **where)
        self._outputs = RunOutputs(acc, self.args, cfg.flat(), tokenizer)
        self.output_dir = self._outputs.output_dir
        self._loss_call = hooks.loss_caller(self._compute_loss_and_metrics, type(self), base)
        self._step_takes_num_items = hooks.positional_count(self.training_step) >= 3  # False: a 2-argument override
        self._callbacks = RunCallbacks(callbacks or [], self, cfg, acc)
        self.callbacks = self._callbacks.all
        self._step_guard = StepGuard(self.args.max_nonfinite_steps)  # NaN/inf steps skipped, N in a row stop
        self._stop = StopRequest()  # SIGTERM / first Ctrl-C: save after the current optimizer step (runs/stops.py)
