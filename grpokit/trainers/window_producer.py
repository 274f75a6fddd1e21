"""Windows from rollouts: (dynamic sampling) → tensors and old/ref logps → advantages → metrics → a ``Window``.
The rollout itself (engine and rewards) is the base class's, ``Rollouts`` (rollouts.py); the buffer of
asynchronous training (group_buffer.py) rolls out ahead through the same call."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from grpokit.algorithms import compute_advantages, kl_reward_penalty
from grpokit.config.plan import BatchPlan
from grpokit.distributed.processes import gather_objects, gather_rows, row_offset
from grpokit.errors import PluginError
from grpokit.rollout.tito import tito_metrics
from grpokit.runs.outputs import CompletionLimits
from grpokit.trainers.batch import RolloutBatch, collate
from grpokit.trainers.completion_log import TokenForward, completion_log_rows
from grpokit.trainers.dynamic_sampling import dynamic_sampling
from grpokit.trainers.forward import batched_logps, sampler_support
from grpokit.trainers.prompts import PromptStream
from grpokit.trainers.rollouts import Rollouts, WindowHooks
from grpokit.trainers.window import (
    Window,
    WindowRollout,
    advantage_stats,
    engine_old_logps,
    sample_rows,
    trajectory_images,
    window_metrics,
    window_num_items,
)

logger = logging.getLogger(__name__)


@dataclass
class Models:
    """The models a window's logps come from: the (wrapped) training model, the unwrapped policy (its LoRA
    adapter is switched off for reference logps) and the reference model, if any."""

    model: Any
    policy: Any
    ref_model: Any
    micro_batch_size: int
    teachers: Any = None  # trainers/teachers.py's Teachers: on-policy distillation, None without a teacher


class WindowProducer(Rollouts):
    """Makes windows: ``rollout(prompts)`` (engine and rewards only: rollouts.py), then ``build(rollout,
    step=...)`` (the training model's logps, advantages, metrics)."""

    def __init__(
        self,
        hooks: WindowHooks,
        prompts: PromptStream,
        *,
        models: Models,
        accelerator,
        plan: BatchPlan,
        log_completions: CompletionLimits | None,
        **rollout_parts,
    ) -> None:
        """``rollout_parts``: ``Rollouts``' (scheduler, template, rewards, rollout_args, algorithm, offloader,
        images)."""
        super().__init__(hooks, prompts, **rollout_parts)
        self.models, self.accelerator, self.plan, self.log_completions = models, accelerator, plan, log_completions
        self.support = sampler_support(
            self.rollout_args, self.algorithm, self.template
        )  # every batch's kept set (or None)
        self._warned_no_signal = False

    # -- the window: uses the training model, on the loop's thread ------------------------------------------
    def build(self, rollout: WindowRollout, *, step: int) -> Window:
        """Dynamic sampling, tensors and old/ref logps, advantages, token counts, metrics and log rows."""
        a = self.algorithm
        requests, outputs, rewards_per_func = rollout.requests, rollout.outputs, rollout.rewards_per_func
        metrics: dict[str, float] = dict(rollout.sampled or {})  # --stream_groups: sampled as groups came in
        if a.dynamic_sample and rollout.sampled is None:
            requests, outputs, rewards_per_func, metrics = dynamic_sampling(
                rollout,
                lambda: self.rollout(self.prompts.next()),
                weights=self.rewards.weights,
                accelerator=self.accelerator,
                max_resample_times=a.max_resample_times,
                num_generations=self.rollout_args.num_generations,
            )
        rows = sample_rows(requests, outputs)  # the seed's `inputs`: one dict per trajectory
        t0 = time.perf_counter()
        self.hooks.phases.set("logps")
        batches = None  # the mini-batches, where a hook needs them
        if self.hooks.prepare_batches is None:
            batch = self.encode_rows(rows, skip_first_step=True)
        else:
            batches = self.hooks.prepare_batches(rows)
            batch = RolloutBatch.join(batches, len(rows), "_prepare_batch_inputs")
        timing = {"logps": time.perf_counter() - t0, **rollout.timing}
        all_rpf = gather_rows(self.accelerator, rewards_per_func)  # [N_global, F]
        est = self.estimate(rows, all_rpf, batch)
        advantages, adv_metrics = est.advantages, est.metrics
        if self.hooks.advantages is not None:
            if batches is None:
                batches = batch.chunks(self.plan.steps_per_generation)
            advantages = self._hook_advantages(rows, all_rpf, batches)
            adv_metrics = {**est.metrics, **advantage_stats(advantages)}
        start = row_offset(self.accelerator, len(outputs))
        batch.advantages = advantages[start : start + len(outputs)].float()
        if self.models.teachers is not None:  # after group normalisation: + c·(teacher − old) per token (distill.py)
            batch.advantages, adv_metrics = self.models.teachers.apply(batch, rows, self._batched_logps, adv_metrics)
        rewards = est.rewards
        num_items = window_num_items(
            batch.completion_mask,
            batch.truncated,
            loss_type=a.loss_type,
            overlong_filter=a.overlong_filter,
            steps_per_generation=self.plan.steps_per_generation,
            gradient_accumulation_steps=self.plan.gradient_accumulation_steps,
            accelerator=self.accelerator,
        )
        metrics = self._metrics(batch, outputs, rewards, adv_metrics, metrics)
        extras, logged = self._reward_logs.take([o.request_id for o in outputs])
        metrics.update({k if k not in metrics else f"reward_log/{k}": v for k, v in logged.items()})
        log_rows = []
        if self.log_completions:  # every rank builds its rows; all of them are gathered (a collective)
            mine = rewards[start : start + len(outputs)]
            log_rows = self._log_rows(requests, outputs, rewards_per_func, batch, mine, step, extras)
        self.hooks.phases.set("train")
        return Window(batch, requests, outputs, rewards_per_func, rewards, metrics, timing, num_items, log_rows)

    def _metrics(self, batch: RolloutBatch, outputs, rewards, adv_metrics: dict, sampled: dict) -> dict:
        """The window's metrics: rewards, lengths, advantages, the scheduler's and reward functions' own."""
        lengths, truncated = (
            gather_rows(self.accelerator, x) for x in (batch.completion_mask.sum(1), batch.truncated.float())
        )
        metrics = {**window_metrics(rewards, lengths, truncated, adv_metrics), **sampled}
        if getattr(self.scheduler, "multi_turn", False):  # ids trained = ids sampled + inserted (rollout/tito.py)
            metrics.update(tito_metrics(batch, outputs, lambda t: gather_rows(self.accelerator, t[None]).sum(0)))
        metrics.update(getattr(self.scheduler, "rollout_metrics", dict)())  # e.g. --agent's episode counts
        funcs = self.rewards.runner.funcs if self.rewards.runner else []
        for name, func in zip(self.rewards.names, funcs):
            for key, value in (getattr(func, "last_metrics", None) or {}).items():  # e.g. code_exec failures
                metrics[f"rewards/{name}/{key}"] = float(value)
        self._warn_without_signal(metrics.get("frac_reward_zero_std", 0.0))
        return metrics

    def _log_rows(self, requests, outputs, rewards_per_func, batch: RolloutBatch, rewards, step: int, extras):
        """This window's completion log rows, every rank's gathered (a collective); ``rewards``: this rank's."""
        forward = TokenForward(self.hooks.logps, self.models.model, self.accelerator, self.models.micro_batch_size)
        log_rows = completion_log_rows(
            requests,
            outputs,
            rewards_per_func,
            batch,
            rewards,
            self.rewards.names,
            step + 1,
            limits=self.log_completions,
            forward=forward,
            tokenizer=self.template.tokenizer,
            images=self.images,
        )
        for row, extra in zip(log_rows, extras):  # log_extra columns (TRL's completions table)
            row.update({k if k not in row else f"extra/{k}": v for k, v in extra.items()})
        return gather_objects(self.accelerator, log_rows)

    def _warn_without_signal(self, zero: float) -> None:
        if zero > 0.8 and not self._warned_no_signal and self.accelerator.is_main_process:
            logger.warning(
                "%.0f%% of groups have all-equal rewards and give no learning signal; consider more "
                "num_generations, a higher temperature, an easier task or a denser reward",
                100 * zero,
            )
            self._warned_no_signal = True

    def estimate(self, rows: list[dict], rewards_per_func: torch.Tensor, batch: RolloutBatch):
        """The registries' group-relative advantages over the global batch: ``rows`` this process's trajectories
        (sample_rows), ``rewards_per_func`` [N_global, F] (gathered), ``batch`` this process's encoded rows (its
        old/ref logps give the --kl_in_reward penalty). Returns AdvantageOut over all processes: advantages
        [N_global], weighted rewards [N_global], the estimator's metrics."""
        a, acc = self.algorithm, self.accelerator
        penalty = None
        if a.kl_in_reward and a.beta != 0:
            penalty = kl_reward_penalty(batch.old_logps, batch.ref_logps, batch.completion_mask, a.beta)
        gids = torch.tensor([int(r["prompt_id"]) for r in rows])
        rid_map: dict[str, int] = {}
        rids = torch.tensor(
            [
                rid_map.setdefault(f"{acc.process_index}:{r['request_id']}", len(rid_map))
                + acc.process_index * 10_000_000
                for r in rows
            ]
        )
        all_g, all_r = (gather_rows(acc, x) for x in (gids, rids))
        all_pen = gather_rows(acc, penalty) if penalty is not None else None
        return compute_advantages(
            rewards_per_func,
            self.rewards.weights,
            all_g,
            estimator=a.advantage_estimator,
            scale=a.scale_rewards,
            request_ids=all_r,
            reward_penalty=all_pen,
            reward_names=self.rewards.names,
        )

    def _hook_advantages(self, rows, rewards_per_func: torch.Tensor, batches: list[RolloutBatch]) -> torch.Tensor:
        """A ``_compute_advantages`` override's advantages, checked: one finite number per global row."""
        out = self.hooks.advantages(rows, rewards_per_func, batches)
        n = rewards_per_func.shape[0]
        if not isinstance(out, torch.Tensor) or out.shape != (n,):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise PluginError(
                f"_compute_advantages returned {got}; return a tensor of shape [{n}] (one advantage "
                "per row of rewards_per_func, every process's rows)"
            )
        if not torch.isfinite(out).all():
            raise PluginError("_compute_advantages returned NaN or infinite advantages")
        return out.detach().float().cpu()

    def encode_rows(self, rows: list[dict], *, skip_first_step: bool = False) -> RolloutBatch:
        """The window's rows (sample_rows) as one batch: trajectories encoded (token ids as generated, never
        re-encoded), old/ref logps added when needed (``skip_first_step``: see ``_old_logps_start``)."""
        requests, outputs = [r["_request"] for r in rows], [r["_output"] for r in rows]
        by_id = {r.request_id: r for r in requests}
        mm = bool(getattr(self.template, "multimodal", False))  # the processor template also takes the images
        samples = [
            self.template.encode_output(
                o.prompt_messages or by_id[o.request_id].messages,
                o,
                **({"images": trajectory_images(o, by_id)} if mm else {}),
            )
            for o in outputs
        ]
        truncated = [o.response.choices[0].finish_reason == "length" for o in outputs]
        r = self.rollout_args
        limit = r.max_completion_length if r.completion_length_limit_scope == "total" else None
        batch = collate(samples, self.template.pad_token_id, truncated, limit)
        batch.sampler_support = self.support  # old, reference and current logps over the sampler's kept set
        batch.weight_version = torch.tensor([-1 if (v := o.oldest_weight_version()) is None else v for o in outputs])
        if r.async_generate or self.algorithm.use_rollout_logprobs:  # generated ahead, or taken as they are
            batch.old_logps = engine_old_logps(batch, required=self.algorithm.use_rollout_logprobs)
        if batch.old_logps is None and (first := self._old_logps_start(len(batch), skip_first_step)) is not None:
            batch.old_logps = self._batched_logps(self.models.model, batch, first)
        if self.algorithm.beta != 0:
            batch.ref_logps = self._ref_logps(batch)
        return batch

    def _old_logps_start(self, rows: int, skip_first_step: bool) -> int | None:
        """The first row whose old logps need a forward; None: no row's. The policy drifts when updated more than
        once per rollout, but in one pass the first optimizer step's rows meet the window's own policy: their old
        logps are the loss forward's, detached (left NaN here; Window.micro_batches then gives those none)."""
        a, spg, gas = self.algorithm, self.plan.steps_per_generation, self.plan.gradient_accumulation_steps
        if (
            (a.kl_in_reward and a.beta != 0)
            or self.rollout_args.async_generate
            or a.num_iterations > 1
            or self.models.teachers is not None
        ):
            return 0  # the penalty and a teacher read every row's; the engine's are copied in; a second pass drifts
        if spg <= gas:
            return None
        return gas * (rows // spg) if skip_first_step else 0

    def _ref_logps(self, batch: RolloutBatch) -> torch.Tensor:
        if self.models.ref_model is not None:
            return self._batched_logps(self.models.ref_model, batch)
        with self.models.policy.disable_adapter():  # LoRA: the base is the reference
            return self._batched_logps(self.models.model, batch)

    def _batched_logps(self, model, batch: RolloutBatch, first: int = 0) -> torch.Tensor:
        """Logps of the window's rows from ``first`` on (NaN before it), in micro-batch-sized chunks, no grad."""
        return batched_logps(
            self.hooks.logps,
            model,
            batch,
            micro=self.models.micro_batch_size,
            accelerator=self.accelerator,
            first=first,
        )
