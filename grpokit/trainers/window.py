"""One window's data as values: what the rollout produced (``WindowRollout``) and what the loop trains on
(``Window``), with the pure helpers that turn one into the other's metrics, token counts and log rows.

The part that drives the rollout and builds windows is ``WindowProducer`` (window_producer.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpokit.algorithms import loss_mask, num_items_per_micro_batch, step_token_counts, uses_global_token_count
from grpokit.data.images import row_images
from grpokit.distributed.processes import gather_rows
from grpokit.errors import ConfigError
from grpokit.protocol import RolloutInferRequest, RolloutOutput
from grpokit.trainers.batch import RolloutBatch


@dataclass
class WindowRollout:
    """One window's trajectories and rewards, before any use of the training model."""

    requests: list[RolloutInferRequest]
    outputs: list[RolloutOutput]
    rewards_per_func: torch.Tensor  # [N, F]
    timing: dict[str, float]  # seconds: rollout, reward
    sampled: dict[str, float] | None = None  # dynamic sampling's metrics where it ran already (--stream_groups)


@dataclass
class Window:
    """What the loop trains on for ``steps_per_generation × num_iterations`` micro-steps (this process's rows)."""

    batch: RolloutBatch  # advantages set; old/ref logps where the loss needs them (NaN old rows: not computed)
    requests: list[RolloutInferRequest]
    outputs: list[RolloutOutput]
    rewards_per_func: torch.Tensor  # [N, F] NaN = not scored
    rewards: torch.Tensor  # [N_global] weighted reward sum (minus the KL penalty with --kl_in_reward), all processes
    metrics: dict[str, float]  # logged with every optimizer step of the window
    timing: dict[str, float]  # seconds: logps, rollout, reward
    num_items: list[float] | None = None  # loss denominator per micro-batch (dapo/cispo/vespo), else None
    completion_rows: list[dict] = field(default_factory=list)  # completions.jsonl rows of every process

    def micro_batches(self, steps_per_generation: int) -> list[RolloutBatch]:
        """The batch cut into ``steps_per_generation`` consecutive slices, each with its loss denominator. A slice
        whose old logps were not computed (the window's first optimizer step trains it with the policy that the
        window starts with) has none: the loss takes its own forward's, detached, as in ms-swift and TRL."""
        micro = self.batch.split(steps_per_generation)
        for mb in micro:
            if mb.old_logps is not None and len(mb) and bool(mb.old_logps.isnan().all()):
                mb.old_logps = None
        if self.num_items is not None:
            for mb, n in zip(micro, self.num_items, strict=True):
                mb.num_items = n
        return micro


def sample_rows(requests: list[RolloutInferRequest], outputs: list[RolloutOutput]) -> list[dict]:
    """The seed's per-trajectory ``inputs`` (what ms-swift's ``_prepare_batch_inputs`` and ``_compute_advantages``
    receive): one dict per output with the row's dataset columns, ``messages``, ``prompt_id``, ``request_id``,
    ``response_token_ids``, ``response_loss_mask``, ``rollout_infos``, ``finish_reason`` and ``is_truncated``;
    ``_request``/``_output`` hold the objects themselves (grpokit's encoder reads them)."""
    by_id = {r.request_id: r for r in requests}
    rows = []
    for o in outputs:
        req = by_id[o.request_id]
        finish = o.response.choices[0].finish_reason if o.response.choices else None
        rows.append(
            {
                **req.data_dict,
                "messages": o.messages,
                "prompt_id": o.prompt_id,
                "request_id": o.request_id,
                "response_token_ids": o.response_token_ids,
                "response_loss_mask": o.response_loss_mask,
                "rollout_infos": o.rollout_infos,
                "finish_reason": finish,
                "is_truncated": finish == "length",
                "_request": req,
                "_output": o,
            }
        )
    return rows


def engine_old_logps(batch: RolloutBatch, *, required: bool) -> torch.Tensor | None:
    """The engine's logprobs of the sampled tokens as the old (behaviour) policy's [N, C], when every trained
    token has one; else None, or with ``required`` (--use_rollout_logprobs) a ConfigError saying how many lack one."""
    lps, trained = batch.rollout_logps, batch.completion_mask.bool()
    if lps is not None and not torch.isnan(lps[trained]).any():
        return torch.nan_to_num(lps, nan=0.0)
    if required:
        missing = int(trained.sum()) if lps is None else int(torch.isnan(lps[trained]).sum())
        raise ConfigError(
            f"--use_rollout_logprobs true: the engine returned no logprob for {missing} of the {int(trained.sum())} "
            "trained tokens of this window (a multi-turn scheduler that does not return rollout_logprobs, or a "
            "_generate_completions override that drops them); return them, or set --use_rollout_logprobs false"
        )
    return None


def advantage_stats(advantages: torch.Tensor) -> dict[str, float]:
    """Mean, std, min and max of [N] advantages (the metrics a ``_compute_advantages`` override's values get)."""
    a = advantages.float()
    std = a.std() if len(a) > 1 else a.new_zeros(())
    values = torch.stack([a.mean(), std, a.min(), a.max()]).tolist()
    return dict(zip(("advantages/mean", "advantages/std", "advantages/min", "advantages/max"), values, strict=True))


def window_num_items(
    completion_mask: torch.Tensor,
    truncated: torch.Tensor,
    *,
    loss_type: str,
    overlong_filter: bool,
    steps_per_generation: int,
    gradient_accumulation_steps: int,
    accelerator,
) -> list[float] | None:
    """dapo/cispo/vespo divide by the global count of trained tokens (the loss mask, after --overlong_filter)
    in each optimizer step; see step_token_counts and num_items_per_micro_batch. None for the other losses."""
    if not uses_global_token_count(loss_type):
        return None
    gas = gradient_accumulation_steps
    mask = loss_mask(completion_mask, truncated, overlong_filter)
    per_step_local = step_token_counts(mask, steps_per_generation, gas)  # [S / gas]
    per_step = gather_rows(accelerator, per_step_local.unsqueeze(0)).sum(0)  # global count per optimizer step
    return num_items_per_micro_batch(per_step, gas, accelerator.num_processes)


def window_metrics(
    rewards: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor, advantage_metrics: dict[str, float]
) -> dict[str, float]:
    """Reward and completion-length statistics over the global window ([N_global] each), then the advantage
    estimator's metrics (its reward mean is logged per function, as rewards/<name>/mean)."""
    names = (
        "reward",
        "reward_std",
        "completions/mean_length",
        "completions/max_length",
        "completions/min_length",
        "completions/clipped_ratio",
    )
    lengths = lengths.float()
    values = torch.stack(
        [
            rewards.mean(),
            rewards.std() if len(rewards) > 1 else rewards.new_zeros(()),
            lengths.mean(),
            lengths.max(),
            lengths.min(),
            truncated.float().mean(),
        ]
    ).tolist()  # one conversion for all of them
    m: dict[str, float] = dict(zip(names, values, strict=True))
    m.update({k: v for k, v in advantage_metrics.items() if k != "reward/mean"})
    return m


def completion_rows(
    requests: list[RolloutInferRequest],
    outputs: list[RolloutOutput],
    rewards_per_func: torch.Tensor,
    advantages: torch.Tensor,
    reward_names: list[str],
    step: int,
) -> list[dict]:
    """completions.jsonl rows: prompt, completion, advantage, each reward; the whole conversation when the
    trajectory has more than one turn."""
    by_id = {r.request_id: r for r in requests}
    rows = []
    for i, o in enumerate(outputs):
        row = {
            "step": step,
            "prompt": by_id[o.request_id].messages[-1]["content"],
            "completion": o.messages[-1]["content"] if o.messages else "",
            "advantage": float(advantages[i]),
            **{n: _num(rewards_per_func[i, j]) for j, n in enumerate(reward_names)},
        }
        if len(o.messages) > len(by_id[o.request_id].messages) + 1:
            row["messages"] = o.messages
        rows.append(row)
    return rows


def _num(x: torch.Tensor) -> float | None:
    v = float(x)
    return None if v != v else v


def trajectory_images(output: RolloutOutput, by_id: dict) -> list:
    """A trajectory's images: the row's, then its observations' (``rollout_infos['images']``, ms-swift's key)."""
    if "images" in output.rollout_infos:
        return list(output.rollout_infos["images"] or [])
    return row_images(by_id[output.request_id].data_dict)


def token_versions(output: RolloutOutput, start: int) -> list[list[int]]:
    """Per segment, per token: the server's tags where its answer carries them for the one segment (single-turn),
    else ``start``, the version the rollout began with (the oldest any token can be). A trajectory without tokens
    (an end-of-text token alone, stripped) keeps one entry: ``[[start]]``."""
    segments = output.response_token_ids
    if not any(segments):
        return [[start]]
    tagged = output.response.choices[-1].weight_versions if output.response.choices else None
    if len(segments) == 1 and tagged is not None and len(tagged) == len(segments[0]):
        return [list(tagged)]
    return [[start] * len(seg) for seg in segments]
