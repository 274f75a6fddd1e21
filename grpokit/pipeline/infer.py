"""`grpokit infer` and `grpokit eval`: completions and reward scores of a model or checkpoint on a dataset (greedy, or
with --num_generations_eval K also pass@k and mean@K: pipeline/evaluate.py)."""

from __future__ import annotations

import torch

from grpokit.config.args import ModelArguments
from grpokit.data.loading import load_dataset_spec, normalize_rows, resolve_system
from grpokit.engines.transformers_engine import TransformersEngine
from grpokit.pipeline.evaluate import eval_settings, score_and_report
from grpokit.pipeline.infer_checks import OutputFile, check_numbers, check_reward_names
from grpokit.pipeline.models import load_for_inference, resolve_model_path
from grpokit.plugins.loader import load_plugins
from grpokit.rewards import build_reward_funcs
from grpokit.rewards.runner import RewardRunner
from grpokit.rollout.evaluate import EvalResult
from grpokit.template.encode import ChatTemplate


def run_infer(args) -> EvalResult:
    """Check every option and the output path, read the dataset, then load a model (full or LoRA adapter folder),
    generate on the dataset, print (and write) the scores."""
    check_numbers(args)
    eval_settings(args)  # the sampling options, each in its engine's range
    load_plugins(args.external_plugins)
    check_reward_names(args.reward_funcs)
    output = OutputFile(args.output)  # writable, probed: before any work
    try:
        system = resolve_system(args.system)  # a .txt value is a file, as in `grpokit train`
        ds = normalize_rows(load_dataset_spec(args.dataset, seed=args.seed), system)
        rows = [ds[i] for i in range(min(len(ds), args.limit or len(ds)))]
        torch.manual_seed(args.seed)
        if args.threads:
            torch.set_num_threads(args.threads)
        path = args.model or resolve_model_path(ModelArguments(model=None))
        model, tokenizer = load_for_inference(path, args.torch_dtype)
        model.eval()
        template = ChatTemplate(tokenizer, system=system)
        funcs = build_reward_funcs(args.reward_funcs, {"max_completion_length": args.max_new_tokens}, tokenizer)
        runner = RewardRunner(funcs, args.reward_funcs)
        engine = TransformersEngine(
            model, template, fast_decode=args.fast_decode == "true", infer_on_loop_thread=True
        )  # this job owns its rollout loop, as the trainer does
        try:  # the scores, the table and the output file: pipeline/evaluate.py
            return score_and_report(engine, template, rows, runner, args, path, output)
        finally:
            runner.close()
    finally:
        output.discard()
