"""The rollout half of training: prompts → trajectories → rewards → (dynamic sampling) → tensors and old/ref
logps → advantages → a ``Window``. ``RolloutBuffer`` (--max_staleness) runs rollouts ahead in a background thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from grpokit.algorithms import compute_advantages, groups_with_signal, kl_reward_penalty
from grpokit.config.args import AlgorithmArguments, RolloutArguments
from grpokit.config.plan import BatchPlan
from grpokit.distributed.offload import Offloader
from grpokit.distributed.processes import gather_objects, gather_rows, row_offset
from grpokit.errors import PluginError
from grpokit.protocol import RequestConfig, RolloutInferRequest, RolloutOutput
from grpokit.rewards.calling import RewardLog, RewardLogBook, as_trainer_state, swift_kwargs
from grpokit.rollout.scheduler import run_trajectories
from grpokit.rollout.tito import tito_metrics
from grpokit.runs.outputs import CompletionLimits
from grpokit.runs.progress import Phases
from grpokit.trainers.batch import RolloutBatch, collate
from grpokit.trainers.completion_log import TokenForward, completion_log_rows
from grpokit.trainers.forward import sampler_support
from grpokit.trainers.prompts import PromptStream
from grpokit.trainers.window import (
    Window,
    WindowRollout,
    advantage_stats,
    engine_old_logps,
    sample_rows,
    token_versions,
    trajectory_images,
    window_metrics,
    window_num_items,
)

logger = logging.getLogger(__name__)


@dataclass
class Rewards:
    """The reward functions and models (``runner``, None with only a gym reward), one name and weight per column
    of the [N, F] scores; ``uses_env_reward``: the scheduler's gym reward is the last column."""

    names: list[str]
    weights: torch.Tensor  # [F]
    runner: Any
    uses_env_reward: bool


@dataclass
class Models:
    """The models a window's logps come from: the (wrapped) training model, the unwrapped policy (its LoRA
    adapter is switched off for reference logps) and the reference model, if any."""

    model: Any
    policy: Any
    ref_model: Any
    micro_batch_size: int
    teachers: Any = None  # trainers/teachers.py's Teachers: on-policy distillation, None without a teacher


@dataclass
class WindowHooks:
    """The callables a ``WindowProducer`` calls where the trainer's hooks apply: the trainer's bound methods for
    the hooks a subclass overrides, None for the others (the producer then runs its own default directly; the
    trainer's default methods are thin entries into the same functions, for ``super()`` calls)."""

    logps: Callable  # (model, batch, compute_entropy=False) -> ([B, C] logps, entropies or None)
    progress: Callable[[], dict]  # {"global_step", "max_steps"}: what reward functions get as trainer_state
    generate: Callable | None = None  # (requests) -> outputs
    score: Callable | None = None  # (requests, outputs) -> [N, F]
    prepare_batches: Callable | None = None  # (rows) -> list of mini-batches (RolloutBatch)
    advantages: Callable | None = None  # (rows, rewards_per_func [N_global, F], mini-batches) -> [N_global]
    phases: Phases = field(default_factory=Phases)  # what the progress bar says the loop is doing (progress.py)


class WindowProducer:
    """Makes windows: ``rollout(prompts)`` (engine and rewards only), then ``build(rollout, step=...)`` (the
    training model's logps, advantages, metrics). Overridden trainer hooks are reached through ``hooks``;
    ``prompts`` (the PromptStream, also drawn from by dynamic sampling and RolloutBuffer) is public, the rest is
    its own."""

    def __init__(self, hooks: WindowHooks, prompts: PromptStream, *, scheduler, template, rewards: Rewards,
                 models: Models, accelerator, rollout_args: RolloutArguments, algorithm: AlgorithmArguments,
                 plan: BatchPlan, log_completions: CompletionLimits | None, offloader: Offloader | None = None,
                 images: bool | None = None) -> None:
        self.hooks, self.prompts, self.scheduler, self.template = hooks, prompts, scheduler, template
        self._generate = hooks.generate or self.generate
        self._score = hooks.score or (lambda requests, outputs: self.score(requests, outputs, hooks.progress()))
        self.rewards, self.models, self.accelerator = rewards, models, accelerator
        self.rollout_args, self.algorithm, self.plan = rollout_args, algorithm, plan
        self.log_completions = log_completions
        self.weights_at = 0  # the engine's weight version: the optimizer step of the last sync (the loop sets it)
        self._engine_lock = threading.Lock()  # the background producer and dynamic sampling take turns
        self.offloader = offloader  # --offload_model/--offload_optimizer: applied around generation only
        self._around_generation = offloader.offloaded if offloader is not None else nullcontext  # decided once
        # decided once, not per request: whether trajectories carry images (a vision-language template, or rows
        # with an images column); a text-only run never looks for them
        self.images = bool(getattr(template, "multimodal", False)) if images is None else images
        self.request_config = RequestConfig(
            n=1, max_tokens=rollout_args.max_completion_length, temperature=rollout_args.temperature,
            top_p=rollout_args.top_p, top_k=rollout_args.top_k, repetition_penalty=rollout_args.repetition_penalty,
            stop=list(rollout_args.stop_words),
            logprobs=bool(algorithm.rollout_importance_sampling_mode or rollout_args.async_generate
                          or algorithm.use_rollout_logprobs  # the behaviour policy's, for the ratio or the mask
                          or algorithm.off_policy_sequence_mask_delta is not None),
            structured_outputs_regex=rollout_args.structured_outputs_regex,
            structured_outputs_json=rollout_args.structured_outputs_json)
        self.support = sampler_support(rollout_args, algorithm, template)  # every batch's kept set (or None)
        self._warned_no_signal = False
        self._reward_logs = RewardLogBook()  # log_extra / log_metric records until their window is built

    # -- the rollout: engine and rewards only (safe in the async thread) -----------------------------------
    def rollout(self, prompts: list[dict], version: int | None = None) -> WindowRollout:
        """Trajectories and their rewards, each tagged with ``version`` (default: the engine's weight version
        now). Touches only the engine and the rewards, never the training model, so --max_staleness can run it
        in a background thread."""
        t0 = time.perf_counter()
        self.hooks.phases.set("rollout")
        requests = self.requests(prompts)
        outputs = self._generate_tagged(requests, version)
        t1 = time.perf_counter()
        self.hooks.phases.set("reward")
        rewards_per_func = self.rewards_of(requests, outputs)
        return WindowRollout(requests, outputs, rewards_per_func,
                             {"rollout": t1 - t0, "reward": time.perf_counter() - t1})

    def _generate_tagged(self, requests: list[RolloutInferRequest], version: int | None) -> list[RolloutOutput]:
        with self._engine_lock, self._around_generation():  # --offload_*: the training model waits in CPU memory
            version = self.weights_at if version is None else version
            outputs = self._generate(requests)
        return self.tag(outputs, version)

    @staticmethod
    def tag(outputs: list[RolloutOutput], version: int) -> list[RolloutOutput]:
        """Each token's weight version: the server's tags, else ``version`` (the one its rollout began with)."""
        for o in outputs:
            o.weight_versions = token_versions(o, version)
        return outputs

    def rewards_of(self, requests: list[RolloutInferRequest], outputs: list[RolloutOutput]) -> torch.Tensor:
        """[N, F] rewards through the trainer's ``_score_completions`` where overridden, else ``score``."""
        return self._score(requests, outputs)

    def requests(self, prompts: list[dict]) -> list[RolloutInferRequest]:
        """num_generations requests per prompt; the row's other columns travel as ``data_dict``."""
        out = []
        for row in prompts:
            data = {k: v for k, v in row.items() if k not in ("messages", "_prompt_index")}
            for _ in range(self.rollout_args.num_generations):
                out.append(RolloutInferRequest(messages=self.template.with_system(row["messages"]),
                                               data_dict=data, prompt_id=str(row["_prompt_index"])))
        return out

    def generate(self, requests: list[RolloutInferRequest]) -> list[RolloutOutput]:
        """Trajectories through the scheduler (which drives the engine or a rollout client)."""
        return run_trajectories(self.scheduler, requests, self.request_config)

    def score(self, requests, outputs: list[RolloutOutput], trainer_state: Any) -> torch.Tensor:
        """[N, F] rewards (NaN = not scored) from every reward function and model; gym rewards as a last column."""
        by_id = {r.request_id: r for r in requests}
        completions = [o.messages[-1]["content"] if o.messages and o.messages[-1]["role"] == "assistant"
                       else o.response.choices[0].message["content"] for o in outputs]
        kwargs: dict[str, Any] = {}
        for col in {k for r in requests for k in r.data_dict}:
            kwargs[col] = [by_id[o.request_id].data_dict.get(col) for o in outputs]
        images = [trajectory_images(o, by_id) if self.images else [] for o in outputs]  # the row's, then later turns'
        if any(images):  # as ms-swift: a trajectory's images replace the row's column
            kwargs["images"] = images
        token_ids = [[t for seg in o.response_token_ids for t in seg] for o in outputs]
        trajectories: dict[str, list[dict]] = {}  # ms-swift's trajectory_inputs: every output (round) of a request
        for o, imgs in zip(outputs, images):
            row = swift_kwargs(by_id[o.request_id].data_dict)  # the dataset columns, no hidden ones
            trajectories.setdefault(o.request_id, []).append(
                {**row, **({"images": imgs} if imgs else {}), "messages": o.messages, "rollout_infos": o.rollout_infos})
        kwargs.update(
            messages=[o.messages for o in outputs], response_token_ids=token_ids, completion_ids=token_ids,
            rollout_infos=[o.rollout_infos for o in outputs],
            finish_reason=[o.response.choices[0].finish_reason for o in outputs],
            is_truncated=[o.response.choices[0].finish_reason == "length" for o in outputs],
            num_turns=[o.rollout_infos.get("num_turns", 1) for o in outputs],
            trainer_state=as_trainer_state(trainer_state),
            prompts=[o.prompt_messages or by_id[o.request_id].messages for o in outputs],
            request_id=[o.request_id for o in outputs],
            trajectory_inputs=trajectories)
        runner, log = self.rewards.runner, RewardLog(len(outputs))
        scores = runner.compute(completions, kwargs, log) if runner else torch.zeros(len(outputs), 0)
        self._reward_logs.add([o.request_id for o in outputs], log)
        if self.rewards.uses_env_reward:
            env = torch.tensor([float(o.rollout_infos.get("total_reward", float("nan"))) for o in outputs])
            scores = torch.cat([scores, env.unsqueeze(1)], dim=1)
        return scores

    # -- the window: uses the training model, on the loop's thread ------------------------------------------
    def build(self, rollout: WindowRollout, *, step: int) -> Window:
        """Dynamic sampling, tensors and old/ref logps, advantages, token counts, metrics and log rows."""
        a = self.algorithm
        requests, outputs, rewards_per_func = rollout.requests, rollout.outputs, rollout.rewards_per_func
        metrics: dict[str, float] = dict(rollout.sampled or {})  # --stream_groups: sampled as groups came in
        if a.dynamic_sample and rollout.sampled is None:
            requests, outputs, rewards_per_func, metrics = self._dynamic_sampling(requests, outputs,
                                                                                  rewards_per_func)
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
        batch.advantages = advantages[start:start + len(outputs)].float()
        if self.models.teachers is not None:  # after group normalisation: + c·(teacher − old) per token (distill.py)
            batch.advantages, adv_metrics = self.models.teachers.apply(batch, rows, self._batched_logps, adv_metrics)
        rewards = est.rewards
        num_items = window_num_items(
            batch.completion_mask, batch.truncated, loss_type=a.loss_type, overlong_filter=a.overlong_filter,
            steps_per_generation=self.plan.steps_per_generation,
            gradient_accumulation_steps=self.plan.gradient_accumulation_steps, accelerator=self.accelerator)
        lengths, truncated = (gather_rows(self.accelerator, x)
                              for x in (batch.completion_mask.sum(1), batch.truncated.float()))
        metrics = {**window_metrics(rewards, lengths, truncated, adv_metrics), **metrics}
        if getattr(self.scheduler, "multi_turn", False):  # ids trained = ids sampled + inserted (rollout/tito.py)
            metrics.update(tito_metrics(batch, outputs, lambda t: gather_rows(self.accelerator, t[None]).sum(0)))
        metrics.update(getattr(self.scheduler, "rollout_metrics", dict)())  # e.g. --agent's episode counts
        funcs = self.rewards.runner.funcs if self.rewards.runner else []
        for name, func in zip(self.rewards.names, funcs):
            for key, value in (getattr(func, "last_metrics", None) or {}).items():  # e.g. code_exec failures
                metrics[f"rewards/{name}/{key}"] = float(value)
        self._warn_without_signal(metrics.get("frac_reward_zero_std", 0.0))
        extras, logged = self._reward_logs.take([o.request_id for o in outputs])
        metrics.update({k if k not in metrics else f"reward_log/{k}": v for k, v in logged.items()})
        log_rows = []
        if self.log_completions:  # every rank builds its rows; all of them are gathered (a collective)
            forward = TokenForward(self.hooks.logps, self.models.model, self.accelerator, self.models.micro_batch_size)
            log_rows = completion_log_rows(requests, outputs, rewards_per_func, batch,
                                           rewards[start:start + len(outputs)], self.rewards.names, step + 1,
                                           limits=self.log_completions, forward=forward,
                                           tokenizer=self.template.tokenizer, images=self.images)
            for row, extra in zip(log_rows, extras):  # log_extra columns (TRL's completions table)
                row.update({k if k not in row else f"extra/{k}": v for k, v in extra.items()})
            log_rows = gather_objects(self.accelerator, log_rows)
        self.hooks.phases.set("train")
        return Window(batch, requests, outputs, rewards_per_func, rewards, metrics, timing, num_items, log_rows)

    def _warn_without_signal(self, zero: float) -> None:
        if zero > 0.8 and not self._warned_no_signal and self.accelerator.is_main_process:
            logger.warning("%.0f%% of groups have all-equal rewards and give no learning signal; consider more "
                           "num_generations, a higher temperature, an easier task or a denser reward", 100 * zero)
            self._warned_no_signal = True

    def _dynamic_sampling(self, requests, outputs, rewards_per_func):
        """DAPO: replace groups whose rewards are all equal by fresh ones, up to max_resample_times rounds.

        With many processes every round is gathered, so all ranks pick the same groups from the global batch (as
        one process would) and stay in step on the prompt stream; each rank then keeps its slice."""
        acc = self.accelerator
        world, rank = acc.num_processes, acc.process_index
        target = len(outputs) * world
        keep_s, spare = [], []  # (request, output, rewards) of groups with / without a learning signal
        rounds = 0
        while True:
            if world > 1:
                requests, outputs = (gather_objects(acc, x) for x in (requests, outputs))
                rewards_per_func = gather_rows(acc, rewards_per_func)
            rewards = torch.nansum(rewards_per_func * self.rewards.weights, dim=1)
            signal = groups_with_signal(rewards, torch.tensor([int(o.prompt_id) for o in outputs]))
            for i, (r, o) in enumerate(zip(requests, outputs)):
                (keep_s if signal[i] else spare).append((r, o, rewards_per_func[i]))
            if len(keep_s) >= target or rounds >= self.algorithm.max_resample_times:
                break
            rounds += 1
            requests = self.requests(self.prompts.next())
            outputs = self._generate_tagged(requests, None)  # on the current weights
            rewards_per_func = self._score(requests, outputs)
        chosen = (keep_s + spare)[:target]  # filled up from signal-free groups when resampling ran out
        filler = max(0, len(chosen) - len(keep_s))
        stats = {"dynamic_sampling/rounds": rounds,
                 "dynamic_sampling/groups_without_signal": filler / self.rollout_args.num_generations}
        share = target // world  # whole groups: target and every group-ordered block are multiples of G
        chosen = chosen[rank * share:(rank + 1) * share]
        return [c[0] for c in chosen], [c[1] for c in chosen], torch.stack([c[2] for c in chosen]), stats

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
        rids = torch.tensor([rid_map.setdefault(f"{acc.process_index}:{r['request_id']}", len(rid_map))
                             + acc.process_index * 10_000_000 for r in rows])
        all_g, all_r = (gather_rows(acc, x) for x in (gids, rids))
        all_pen = gather_rows(acc, penalty) if penalty is not None else None
        return compute_advantages(rewards_per_func, self.rewards.weights, all_g, estimator=a.advantage_estimator,
                                  scale=a.scale_rewards, request_ids=all_r, reward_penalty=all_pen,
                                  reward_names=self.rewards.names)

    def _hook_advantages(self, rows, rewards_per_func: torch.Tensor, batches: list[RolloutBatch]) -> torch.Tensor:
        """A ``_compute_advantages`` override's advantages, checked: one finite number per global row."""
        out = self.hooks.advantages(rows, rewards_per_func, batches)
        n = rewards_per_func.shape[0]
        if not isinstance(out, torch.Tensor) or out.shape != (n,):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise PluginError(f"_compute_advantages returned {got}; return a tensor of shape [{n}] (one advantage "
                              "per row of rewards_per_func, every process's rows)")
        if not torch.isfinite(out).all():
            raise PluginError("_compute_advantages returned NaN or infinite advantages")
        return out.detach().float().cpu()

    def encode_rows(self, rows: list[dict], *, skip_first_step: bool = False) -> RolloutBatch:
        """The window's rows (sample_rows) as one batch: trajectories encoded (token ids as generated, never
        re-encoded), old/ref logps added when needed (``skip_first_step``: see ``_old_logps_start``)."""
        requests, outputs = [r["_request"] for r in rows], [r["_output"] for r in rows]
        by_id = {r.request_id: r for r in requests}
        mm = bool(getattr(self.template, "multimodal", False))  # the processor template also takes the images
        samples = [self.template.encode_output(o.prompt_messages or by_id[o.request_id].messages, o,
                                               **({"images": trajectory_images(o, by_id)} if mm else {}))
                   for o in outputs]
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
        if ((a.kl_in_reward and a.beta != 0) or self.rollout_args.async_generate or a.num_iterations > 1
                or self.models.teachers is not None):
            return 0  # the penalty and a teacher read every row's; the engine's are copied in; a second pass drifts
        if spg <= gas:
            return None
        return gas * (rows // spg) if skip_first_step else 0

    def _ref_logps(self, batch: RolloutBatch) -> torch.Tensor:
        if self.models.ref_model is not None:
            return self._batched_logps(self.models.ref_model, batch)
        with self.models.policy.disable_adapter():  # LoRA: the base is the reference
            return self._batched_logps(self.models.model, batch)

    @torch.no_grad()
    def _batched_logps(self, model, batch: RolloutBatch, first: int = 0) -> torch.Tensor:
        """Logps of the window's rows from ``first`` on (NaN before it), in micro-batch-sized chunks, no grad."""
        out = torch.zeros_like(batch.completion_mask)
        out[:first] = float("nan")
        b = self.models.micro_batch_size
        for start in range(first, len(batch), b):
            chunk = batch.select(slice(start, start + b)).trim().to(self.accelerator.device)
            with self.accelerator.autocast():
                lp, _ = self.hooks.logps(model, chunk)
            out[start:start + b, : lp.shape[1]] = lp.float().cpu()
        return out

