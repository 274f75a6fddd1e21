"""The rollout half of GRPOTrainer: prompts → trajectories → rewards → advantages → tensors for the window.

Kept in its own file so each half of the trainer reads in one sitting; every method is an override point.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from grpokit.algorithms import (
    compute_advantages,
    groups_with_signal,
    kl_reward_penalty,
    loss_mask,
    num_items_per_micro_batch,
    step_token_counts,
    uses_global_token_count,
)
from grpokit.rollout.protocol import RequestConfig, RolloutInferRequest, RolloutOutput
from grpokit.rollout.scheduler import run_trajectories
from grpokit.trainers.batch import RolloutBatch, collate
from grpokit.trainers.distributed import gather_objects

logger = logging.getLogger(__name__)

# Prompts read from the dataset at once, in whole windows (at least one): a ``datasets.Dataset`` read costs about
# 0.3 ms however few rows it returns, which was most of the cost of fetching a small window's prompts.
PROMPT_READ_AHEAD_ROWS = 64


class RolloutStepMixin:
    # -- prompts ---------------------------------------------------------------------------------------------
    def _next_prompts(self) -> list[dict]:
        """This process's share of the next window's prompts, from a seeded per-epoch permutation."""
        per_window = self.plan.prompts_per_rollout
        n = len(self.train_dataset)
        share = per_window // self.accelerator.num_processes
        first = self.state.prompts_consumed + self.accelerator.process_index * share
        self.state.prompts_consumed += per_window
        positions = range(first, first + share)
        if first not in self._read_ahead:  # this window and the next ones in one dataset read
            windows = max(1, PROMPT_READ_AHEAD_ROWS // share)
            ahead = [pos + w * per_window for w in range(windows) for pos in positions]
            indices = [int(self._epoch_order(epoch)[idx]) for epoch, idx in (divmod(pos, n) for pos in ahead)]
            self._read_ahead = dict(zip(ahead, self._rows(indices), strict=True))
        return [{"_prompt_index": pos, **self._read_ahead.pop(pos)} for pos in positions]

    def _rows(self, indices: list[int]) -> list[dict]:
        """Dataset rows by index; one read for a ``datasets.Dataset`` (a read per row costs ~0.1 ms there)."""
        ds = self.train_dataset
        if not hasattr(ds, "column_names") or not indices:
            return [ds[i] for i in indices]
        columns = ds[indices]
        return [dict(zip(columns, values, strict=True)) for values in zip(*columns.values(), strict=True)]

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if self.cfg.data.dataset_shuffle:
                g = torch.Generator().manual_seed(self.args.seed + epoch)
                self._orders = {epoch: torch.randperm(len(self.train_dataset), generator=g)}
            else:
                self._orders = {epoch: torch.arange(len(self.train_dataset))}
        return self._orders[epoch]

    # -- the window ------------------------------------------------------------------------------------------
    def _prepare_inputs(self, prompts: list[dict], rollout: WindowRollout | None = None) -> list[RolloutBatch]:
        """Generate and score one window (or take the one generated ahead), cut into steps_per_generation
        micro-batches."""
        batch = self._generate_and_score_completions(prompts, rollout)
        num_items = batch.extra.pop("num_items_per_micro", None)
        micro_batches = batch.split(self.plan.steps_per_generation)
        if num_items is not None:
            for mb, n in zip(micro_batches, num_items, strict=True):
                mb.num_items = n
        return micro_batches

    def _build_requests(self, prompts: list[dict]) -> list[RolloutInferRequest]:
        g = self.cfg.rollout.num_generations
        requests = []
        for row in prompts:
            data = {k: v for k, v in row.items() if k not in ("messages", "_prompt_index")}
            for _ in range(g):
                requests.append(RolloutInferRequest(messages=self.template.with_system(row["messages"]),
                                                    data_dict=data, prompt_id=str(row["_prompt_index"])))
        return requests

    def _generate_completions(self, requests: list[RolloutInferRequest]) -> list[RolloutOutput]:
        """Trajectories for the requests, through the scheduler (which drives the engine or a rollout client)."""
        return run_trajectories(self.scheduler, requests, self.request_config)

    def _rollout_window(self, prompts: list[dict]) -> WindowRollout:
        """Trajectories and their rewards. Touches only the engine and the rewards, never the training model,
        so --async_generate can run it in a background thread."""
        t0 = time.perf_counter()
        requests = self._build_requests(prompts)
        outputs = self._generate_completions(requests)
        t1 = time.perf_counter()
        rewards_per_func = self._score_completions(requests, outputs)
        return WindowRollout(requests, outputs, rewards_per_func,
                             {"rollout": t1 - t0, "reward": time.perf_counter() - t1})

    def _generate_and_score_completions(self, prompts: list[dict],
                                        rollout: WindowRollout | None = None) -> RolloutBatch:
        rollout = rollout or self._rollout_window(prompts)
        # the weight sync that ended the previous window is reported with this one
        self._timing = {"logps": 0.0, "train": 0.0, **rollout.timing, "sync": self._last_sync_s}
        requests, outputs, rewards_per_func = rollout.requests, rollout.outputs, rollout.rewards_per_func
        if self.cfg.algorithm.dynamic_sample:
            requests, outputs, rewards_per_func = self._dynamic_sampling(requests, outputs, rewards_per_func)
        batch = self._prepare_batch_inputs(requests, outputs)
        penalty = None
        if self.cfg.algorithm.kl_in_reward and self.cfg.algorithm.beta != 0:
            penalty = kl_reward_penalty(batch.old_logps, batch.ref_logps, batch.completion_mask,
                                        self.cfg.algorithm.beta)
        batch.advantages = self._compute_advantages(outputs, rewards_per_func, penalty)
        self._set_num_items(batch)
        self._record_window(requests, outputs, rewards_per_func, batch)
        return batch

    def _score_completions(self, requests, outputs: list[RolloutOutput]) -> torch.Tensor:
        """[N, F] rewards (NaN = not scored) from every reward function and model; gym rewards as a last column."""
        by_id = {r.request_id: r for r in requests}
        completions = [o.messages[-1]["content"] if o.messages and o.messages[-1]["role"] == "assistant"
                       else o.response.choices[0].message["content"] for o in outputs]
        kwargs: dict[str, Any] = {}
        columns = {k for r in requests for k in r.data_dict}
        for col in columns:
            kwargs[col] = [by_id[o.request_id].data_dict.get(col) for o in outputs]
        kwargs.update(
            messages=[o.messages for o in outputs],
            response_token_ids=[[t for seg in o.response_token_ids for t in seg] for o in outputs],
            completion_ids=[[t for seg in o.response_token_ids for t in seg] for o in outputs],
            rollout_infos=[o.rollout_infos for o in outputs],
            finish_reason=[o.response.choices[0].finish_reason for o in outputs],
            is_truncated=[o.response.choices[0].finish_reason == "length" for o in outputs],
            num_turns=[o.rollout_infos.get("num_turns", 1) for o in outputs],
            trainer_state={"global_step": self.state.global_step, "max_steps": self.state.max_steps},
        )
        scores = self.reward_runner.compute(completions, kwargs) if self.reward_runner else torch.zeros(len(outputs), 0)
        if self._uses_env_reward:
            env = torch.tensor([float(o.rollout_infos.get("total_reward", float("nan"))) for o in outputs])
            scores = torch.cat([scores, env.unsqueeze(1)], dim=1)
        return scores

    def _dynamic_sampling(self, requests, outputs, rewards_per_func):
        """DAPO: replace groups whose rewards are all equal by fresh ones, up to max_resample_times rounds.

        With many processes every round is gathered, so all ranks pick the same groups from the global batch (as
        one process would) and stay in step on the prompt stream; each rank then keeps its slice."""
        a = self.cfg.algorithm
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        target = len(outputs) * world
        keep_s, spare = [], []  # (request, output, rewards) of groups with / without a learning signal
        rounds = 0
        while True:
            if world > 1:
                requests, outputs = (gather_objects(self.accelerator, x) for x in (requests, outputs))
                rewards_per_func = self._gather_rows(rewards_per_func)
            rewards = torch.nansum(rewards_per_func * self._weights, dim=1)
            gids = torch.tensor([int(o.prompt_id) for o in outputs])
            signal = groups_with_signal(rewards, gids)
            for i, (r, o) in enumerate(zip(requests, outputs)):
                (keep_s if signal[i] else spare).append((r, o, rewards_per_func[i]))
            if len(keep_s) >= target or rounds >= a.max_resample_times:
                break
            rounds += 1
            requests = self._build_requests(self._next_prompts())
            outputs = self._generate_completions(requests)
            rewards_per_func = self._score_completions(requests, outputs)
        chosen = (keep_s + spare)[:target]  # filled up from signal-free groups when resampling ran out
        filler = max(0, len(chosen) - len(keep_s))
        self._dynamic_stats = {"dynamic_sampling/rounds": rounds,
                               "dynamic_sampling/groups_without_signal": filler / self.cfg.rollout.num_generations}
        share = target // world  # whole groups: target and every group-ordered block are multiples of G
        chosen = chosen[rank * share:(rank + 1) * share]
        return [c[0] for c in chosen], [c[1] for c in chosen], torch.stack([c[2] for c in chosen])

    def _compute_advantages(self, outputs: list[RolloutOutput], rewards_per_func: torch.Tensor,
                            penalty: torch.Tensor | None = None) -> torch.Tensor:
        """Group-relative advantages over the global batch (gathered across processes), sliced back."""
        a = self.cfg.algorithm
        gids = torch.tensor([int(o.prompt_id) for o in outputs])
        rid_map: dict[str, int] = {}
        rids = torch.tensor([rid_map.setdefault(f"{self.accelerator.process_index}:{o.request_id}", len(rid_map))
                             + self.accelerator.process_index * 10_000_000 for o in outputs])
        local_n = len(outputs)
        all_scores, all_g, all_r = (self._gather_rows(x) for x in (rewards_per_func, gids, rids))
        all_pen = self._gather_rows(penalty) if penalty is not None else None
        out = compute_advantages(all_scores, self._weights, all_g, estimator=a.advantage_estimator,
                                 scale=a.scale_rewards, request_ids=all_r, reward_penalty=all_pen,
                                 reward_names=self.reward_names)
        self._adv_metrics = out.metrics
        self._window_rewards = out.rewards
        start = self._row_offset(local_n)
        return out.advantages[start:start + local_n].float()

    def _prepare_batch_inputs(self, requests, outputs: list[RolloutOutput]) -> RolloutBatch:
        """Encode trajectories (token ids as generated, never re-encoded) and add old/ref logps when needed."""
        by_id = {r.request_id: r for r in requests}
        samples = [self.template.encode_output(o.prompt_messages or by_id[o.request_id].messages, o)
                   for o in outputs]
        truncated = [o.response.choices[0].finish_reason == "length" for o in outputs]
        limit = (self.cfg.rollout.max_completion_length
                 if self.cfg.rollout.completion_length_limit_scope == "total" else None)
        batch = collate(samples, self.template.pad_token_id, truncated, limit)
        t0 = time.perf_counter()
        if self.async_generate and _complete(batch.rollout_logps, batch.completion_mask):
            # generated one step ago: the engine's logprobs are the behaviour policy's; the live model no longer is
            batch.old_logps = torch.nan_to_num(batch.rollout_logps, nan=0.0)
        elif self._needs_old_logps():
            batch.old_logps = self._batched_logps(self.model, batch)
        if self.cfg.algorithm.beta != 0:
            batch.ref_logps = self._ref_logps(batch)
        self._timing["logps"] += time.perf_counter() - t0
        return batch

    def _needs_old_logps(self) -> bool:
        """The policy drifts inside a window when it is updated more than once per rollout."""
        a = self.cfg.algorithm
        drift = a.num_iterations > 1 or self.plan.steps_per_generation > self.plan.gradient_accumulation_steps
        return drift or (a.kl_in_reward and a.beta != 0) or self.async_generate

    def _ref_logps(self, batch: RolloutBatch) -> torch.Tensor:
        if self.ref_model is not None:
            return self._batched_logps(self.ref_model, batch)
        with self.policy.disable_adapter():  # LoRA: the base is the reference
            return self._batched_logps(self.model, batch)

    def _set_num_items(self, batch: RolloutBatch) -> None:
        """dapo/cispo/vespo divide by the global count of trained tokens (the loss mask, after --overlong_filter)
        in each optimizer step; see step_token_counts and num_items_per_micro_batch."""
        a = self.cfg.algorithm
        if not uses_global_token_count(a.loss_type):
            return
        gas, world = self.plan.gradient_accumulation_steps, self.accelerator.num_processes
        mask = loss_mask(batch.completion_mask, batch.truncated, a.overlong_filter)
        per_step_local = step_token_counts(mask, self.plan.steps_per_generation, gas)  # [S / gas]
        per_step = self._gather_rows(per_step_local.unsqueeze(0)).sum(0)  # global count per optimizer step
        batch.extra["num_items_per_micro"] = num_items_per_micro_batch(per_step, gas, world)

    def _record_window(self, requests, outputs: list[RolloutOutput], rewards_per_func: torch.Tensor,
                       batch: RolloutBatch) -> None:
        """Window-level metrics (logged with each optimizer step of the window) and completions.jsonl rows."""
        lengths = self._gather_rows(batch.completion_mask.sum(1)).float()
        trunc = self._gather_rows(batch.truncated.float())
        r = self._window_rewards
        names = ("reward", "reward_std", "completions/mean_length", "completions/max_length",
                 "completions/min_length", "completions/clipped_ratio")
        values = torch.stack([r.mean(), r.std() if len(r) > 1 else r.new_zeros(()), lengths.mean(), lengths.max(),
                              lengths.min(), trunc.mean()]).tolist()  # one conversion for all of them
        m: dict[str, float] = dict(zip(names, values, strict=True))
        m.update({k: v for k, v in self._adv_metrics.items() if k != "reward/mean"})  # with rewards/<name>/mean
        m.update(getattr(self, "_dynamic_stats", {}))
        for name, func in zip(self.reward_names, self.reward_runner.funcs if self.reward_runner else []):
            for key, value in (getattr(func, "last_metrics", None) or {}).items():  # e.g. code_exec failures
                m[f"rewards/{name}/{key}"] = float(value)
        self._window_metrics = m
        zero = m.get("frac_reward_zero_std", 0.0)
        if zero > 0.8 and not self._warned_no_signal and self.accelerator.is_main_process:
            logger.warning("%.0f%% of groups have all-equal rewards and give no learning signal; consider more "
                           "num_generations, a higher temperature, an easier task or a denser reward", 100 * zero)
            self._warned_no_signal = True
        if self.args.log_completions:  # every rank builds its rows, the main process writes all of them
            by_id = {r.request_id: r for r in requests}
            rows = []
            for i, o in enumerate(outputs):
                row = {"step": self.state.global_step + 1,
                       "prompt": by_id[o.request_id].messages[-1]["content"],
                       "completion": o.messages[-1]["content"] if o.messages else "",
                       "advantage": float(batch.advantages[i]),
                       **{n: _num(rewards_per_func[i, j]) for j, n in enumerate(self.reward_names)}}
                if len(o.messages) > len(by_id[o.request_id].messages) + 1:
                    row["messages"] = o.messages
                rows.append(row)
            for row in gather_objects(self.accelerator, rows):  # a collective; writes only on the main process
                self._completions_file.write(row)

    # -- helpers ---------------------------------------------------------------------------------------------
    def _gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        if self.accelerator.num_processes == 1:
            return t
        from accelerate.utils import gather_object

        return torch.cat(gather_object([t.cpu()]), dim=0)

    def _row_offset(self, local_n: int) -> int:
        if self.accelerator.num_processes == 1:
            return 0
        from accelerate.utils import gather_object

        sizes = gather_object([local_n])
        return sum(sizes[: self.accelerator.process_index])

    def _sync_weights(self) -> None:
        t0 = time.perf_counter()
        self.engine.sync_weights(self.policy)
        if self.accelerator.num_processes > 1:  # rank 0 pushes to a rollout server; the others must not sample
            self.accelerator.wait_for_everyone()  # from it before the push is done
        self._last_sync_s = time.perf_counter() - t0

    @property
    def request_config(self) -> RequestConfig:
        r = self.cfg.rollout
        return RequestConfig(n=1, max_tokens=r.max_completion_length, temperature=r.temperature, top_p=r.top_p,
                             top_k=r.top_k, repetition_penalty=r.repetition_penalty, stop=list(r.stop_words),
                             logprobs=bool(self.cfg.algorithm.rollout_importance_sampling_mode
                                           or self.async_generate),
                             structured_outputs_regex=r.structured_outputs_regex,
                             structured_outputs_json=r.structured_outputs_json)


@dataclass
class WindowRollout:
    """One window's trajectories and rewards, before any use of the training model."""

    requests: list[RolloutInferRequest]
    outputs: list[RolloutOutput]
    rewards_per_func: torch.Tensor  # [N, F]
    timing: dict[str, float]


def _complete(rollout_logps: torch.Tensor | None, mask: torch.Tensor) -> bool:
    """Every trained token has an engine logprob."""
    return rollout_logps is not None and not torch.isnan(rollout_logps[mask.bool()]).any()


def _num(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if v != v else v
