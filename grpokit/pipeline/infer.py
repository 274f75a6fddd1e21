"""`grpokit infer`: completions and reward-based accuracy of a model or checkpoint on a dataset."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpokit.protocol import RequestConfig, RolloutInferRequest


@dataclass
class EvalResult:
    metrics: dict[str, float]
    rows: list[dict] = field(default_factory=list)


def evaluate_rows(engine, template, rows: list[dict], reward_runner, reward_names: list[str], max_tokens: int,
                  temperature: float = 0.0, batch_size: int = 64) -> EvalResult:
    """Greedy (or sampled) completions for ``rows`` scored by the reward functions; mean score per function."""
    config = RequestConfig(n=1, max_tokens=max_tokens, temperature=temperature)
    completions: list[str] = []
    finish: list[str] = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        reqs = [RolloutInferRequest(messages=template.with_system(r["messages"])) for r in chunk]
        for resp in engine.infer(reqs, config):
            completions.append(resp.choices[0].message["content"])
            finish.append(resp.choices[0].finish_reason)
    columns = {k for r in rows for k in r if k != "messages"}
    kwargs = {c: [r.get(c) for r in rows] for c in columns}
    kwargs.update(messages=[[*r["messages"], {"role": "assistant", "content": c}] for r, c in zip(rows, completions)],
                  finish_reason=finish, is_truncated=[f == "length" for f in finish],
                  trainer_state={}, rollout_infos=[{}] * len(rows), num_turns=[1] * len(rows))
    scores = reward_runner.compute(completions, kwargs) if reward_runner else torch.zeros(len(rows), 0)
    metrics = {}
    for j, name in enumerate(reward_names[: scores.shape[1]]):
        col = scores[:, j]
        metrics[name] = float(col[~col.isnan()].mean()) if (~col.isnan()).any() else float("nan")
    out_rows = [{"prompt": r["messages"][-1]["content"], "completion": c,
                 **{n: (None if s != s else float(s)) for n, s in zip(reward_names, scores[i].tolist())}}
                for i, (r, c) in enumerate(zip(rows, completions))]
    return EvalResult(metrics, out_rows)


def run_infer(args) -> EvalResult:
    """Load a model (full or LoRA adapter folder), generate on the dataset, print the scores."""
    from grpokit.data.loading import load_dataset_spec, normalize_rows
    from grpokit.engines.transformers_engine import TransformersEngine
    from grpokit.pipeline.models import load_for_inference, resolve_model_path
    from grpokit.plugins.loader import load_plugins
    from grpokit.rewards import build_reward_funcs
    from grpokit.rewards.runner import RewardRunner
    from grpokit.template.encode import ChatTemplate

    load_plugins(args.external_plugins)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    from grpokit.config.args import ModelArguments

    path = args.model or resolve_model_path(ModelArguments(model=None))
    model, tokenizer = load_for_inference(path, args.torch_dtype)
    model.eval()
    template = ChatTemplate(tokenizer, system=args.system)
    ds = normalize_rows(load_dataset_spec(args.dataset, seed=args.seed), args.system)
    rows = [ds[i] for i in range(len(ds))][: args.limit or None]
    funcs = build_reward_funcs(args.reward_funcs, {"max_completion_length": args.max_new_tokens}, tokenizer)
    runner = RewardRunner(funcs, args.reward_funcs)
    engine = TransformersEngine(model, template)
    engine.fast_decode = args.fast_decode == "true"
    engine.infer_on_loop_thread = True  # this job owns its rollout loop, as the trainer does
    try:
        result = evaluate_rows(engine, template, rows, runner, args.reward_funcs, args.max_new_tokens,
                               temperature=args.temperature, batch_size=args.batch_size)
    finally:
        runner.close()
    scores = ", ".join(f"{k} {v:.3f}" for k, v in result.metrics.items())
    print(f"{path} on {args.dataset} ({len(rows)} prompts, {'greedy' if args.temperature == 0 else 'sampled'}): "
          f"{scores}", flush=True)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "w") as f:
            f.write(json.dumps({"model": path, "dataset": args.dataset, **result.metrics}) + "\n")
            for row in result.rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return result
