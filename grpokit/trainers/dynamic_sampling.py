"""DAPO's dynamic sampling for a window rolled out whole: groups whose rewards are all equal are replaced by
fresh ones, up to --max_resample_times rounds (the buffer of --stream_groups skips such groups as they come in)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpokit.algorithms import groups_with_signal
from grpokit.distributed.processes import gather_objects, gather_rows
from grpokit.trainers.window import WindowRollout


def dynamic_sampling(
    rollout: WindowRollout,
    roll_more: Callable[[], WindowRollout],
    *,
    weights: torch.Tensor,
    accelerator,
    max_resample_times: int,
    num_generations: int,
):
    """The window's (requests, outputs, rewards_per_func) with signal-free groups replaced by those of
    ``roll_more()`` (the next prompts, on the current weights), and the sampling's metrics.

    With many processes every round is gathered, so all ranks pick the same groups from the global batch (as
    one process would) and stay in step on the prompt stream; each rank then keeps its slice."""
    acc = accelerator
    world, rank = acc.num_processes, acc.process_index
    requests, outputs, rewards_per_func = rollout.requests, rollout.outputs, rollout.rewards_per_func
    target = len(outputs) * world
    keep_s, spare = [], []  # (request, output, rewards) of groups with / without a learning signal
    rounds = 0
    while True:
        if world > 1:
            requests, outputs = (gather_objects(acc, x) for x in (requests, outputs))
            rewards_per_func = gather_rows(acc, rewards_per_func)
        rewards = torch.nansum(rewards_per_func * weights, dim=1)
        signal = groups_with_signal(rewards, torch.tensor([int(o.prompt_id) for o in outputs]))
        for i, (r, o) in enumerate(zip(requests, outputs)):
            (keep_s if signal[i] else spare).append((r, o, rewards_per_func[i]))
        if len(keep_s) >= target or rounds >= max_resample_times:
            break
        rounds += 1
        more = roll_more()
        requests, outputs, rewards_per_func = more.requests, more.outputs, more.rewards_per_func
    chosen = (keep_s + spare)[:target]  # filled up from signal-free groups when resampling ran out
    filler = max(0, len(chosen) - len(keep_s))
    stats = {
        "dynamic_sampling/rounds": rounds,
        "dynamic_sampling/groups_without_signal": filler / num_generations,
    }
    share = target // world  # whole groups: target and every group-ordered block are multiples of G
    chosen = chosen[rank * share : (rank + 1) * share]
    return [c[0] for c in chosen], [c[1] for c in chosen], torch.stack([c[2] for c in chosen]), stats
