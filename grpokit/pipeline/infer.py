"""`grpokit infer` and `grpokit eval`: completions and reward scores of a model or checkpoint on a dataset (greedy, or
with --num_generations_eval K also pass@k and mean@K: pipeline/evaluate.py)."""

from __future__ import annotations

import torch

from grpokit.config.args import ModelArguments
from grpokit.data.loading import load_dataset_spec, normalize_rows, resolve_system
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.pipeline.evaluate import score_and_report
from grpokit.pipeline.models import load_for_inference, resolve_model_path
from grpokit.plugins.loader import load_plugins
from grpokit.rewards import build_reward_funcs
from grpokit.rewards.runner import RewardRunner
from grpokit.rollout.evaluate import EvalResult
from grpokit.template.encode import ChatTemplate


def run_infer(args) -> EvalResult:
    """Load a model (full or LoRA adapter folder), generate on the dataset, print (and write) the scores."""
    load_plugins(args.external_plugins)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or resolve_model_path(ModelArguments(model=None))
    model, tokenizer = load_for_inference(path, args.torch_dtype)
    model.eval()
    system = resolve_system(args.system)  # a .txt value is a file, as in `grpokit train`
    template = ChatTemplate(tokenizer, system=system)
    ds = normalize_rows(load_dataset_spec(args.dataset, seed=args.seed), system)
    rows = [ds[i] for i in range(len(ds))][: args.limit or None]
    funcs = build_reward_funcs(args.reward_funcs, {"max_completion_length": args.max_new_tokens}, tokenizer)
    runner = RewardRunner(funcs, args.reward_funcs)
    engine = TransformersEngine(
        model, template, fast_decode=args.fast_decode == "true", infer_on_loop_thread=True
    )  # this job owns its rollout loop, as the trainer does
    try:  # the scores, the table and the output file: pipeline/evaluate.py
        return score_and_report(engine, template, rows, runner, args, path)
    finally:
        runner.close()
