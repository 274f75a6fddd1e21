"""Evaluation on held-out rows: one engine call per batch (greedy by default), scored by the reward functions;
used by the trainer's ``--eval_steps`` and by ``grpokit infer``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpokit.protocol import RequestConfig, RolloutInferRequest


@dataclass
class EvalResult:
    metrics: dict[str, float]
    rows: list[dict] = field(default_factory=list)


def evaluate_rows(engine, template, rows: list[dict], reward_runner, reward_names: list[str], max_tokens: int,
                  temperature: float = 0.0, batch_size: int = 64, trainer_state: dict | None = None) -> EvalResult:
    """Greedy (or sampled) completions for ``rows`` scored by the reward functions; mean score per function.
    ``trainer_state`` is what rewards read as ``trainer_state.global_step`` (the trainer's step; 0 outside one)."""
    config = RequestConfig(n=1, max_tokens=max_tokens, temperature=temperature)
    completions: list[str] = []
    finish: list[str] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        reqs = [RolloutInferRequest(messages=template.with_system(r["messages"]),  # the row's columns (its images)
                                    data_dict={k: v for k, v in r.items() if k != "messages"}) for r in chunk]
        for resp in engine.infer(reqs, config):
            completions.append(resp.choices[0].message["content"])
            finish.append(resp.choices[0].finish_reason)
    columns = {k for r in rows for k in r if k != "messages"}
    kwargs = {c: [r.get(c) for r in rows] for c in columns}
    kwargs.update(messages=[[*r["messages"], {"role": "assistant", "content": c}] for r, c in zip(rows, completions)],
                  finish_reason=finish, is_truncated=[f == "length" for f in finish],
                  trainer_state=trainer_state or {"global_step": 0, "max_steps": 0},
                  rollout_infos=[{}] * len(rows), num_turns=[1] * len(rows))
    scores = reward_runner.compute(completions, kwargs) if reward_runner else torch.zeros(len(rows), 0)
    metrics = {}
    for j, name in enumerate(reward_names[: scores.shape[1]]):
        col = scores[:, j]
        metrics[name] = float(col[~col.isnan()].mean()) if (~col.isnan()).any() else float("nan")
    out_rows = [{"prompt": r["messages"][-1]["content"], "completion": c,
                 **{n: (None if s != s else float(s)) for n, s in zip(reward_names, scores[i].tolist())}}
                for i, (r, c) in enumerate(zip(rows, completions))]
    return EvalResult(metrics, out_rows)
