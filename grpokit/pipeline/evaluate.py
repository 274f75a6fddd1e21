"""The scoring and report of `grpokit infer` and `grpokit eval`: one pass at ``--temperature``, or (with
``--num_generations_eval K``) the evaluation a training run logs (rollout/evaluate.py): a greedy pass and K samples
per prompt, reported as greedy, mean@K and pass@k per reward with 95 % intervals. Prints the table and writes it
(with every completion) as JSON lines to ``--output``."""

from __future__ import annotations

import json
import math
from dataclasses import replace

from pydantic import ValidationError

from grpokit.algorithms.pass_at_k import ks_up_to
from grpokit.errors import ConfigError
from grpokit.pipeline.infer_checks import OutputFile
from grpokit.protocol import RequestConfig
from grpokit.rollout.evaluate import EvalResult, EvalSettings, evaluate_policy, evaluate_rows
from grpokit.runs.outputs import jsonl_line
from grpokit.runs.progress import EvalProgress


def eval_settings(args) -> EvalSettings:
    k = args.num_generations_eval
    if k is not None and k < 1:
        raise ConfigError(f"--num_generations_eval {k}: must be at least 1 (samples per prompt), e.g. 4")
    if k and args.temperature == 0:
        raise ConfigError(
            f"--num_generations_eval {k} samples at --temperature, which is 0 (greedy, the separate "
            "pass); give --temperature 1.0 (or the training run's)"
        )
    if args.batch_size < 1:
        raise ConfigError(f"--batch_size {args.batch_size}: must be at least 1 (prompts per engine call), e.g. 64")
    if not math.isfinite(args.eval_pass_threshold):
        raise ConfigError(f"--eval_pass_threshold {args.eval_pass_threshold}: must be a finite reward value, e.g. 1.0")
    try:  # the engine's own bounds on each sampling setting, said as one line naming the option
        RequestConfig(
            n=k or 1,
            max_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        name = {"max_tokens": "max_new_tokens", "n": "num_generations_eval"}.get(str(err["loc"][0]), err["loc"][0])
        raise ConfigError(f"--{name} {err.get('input')!r}: {err['msg']} (see --help)") from exc
    return EvalSettings(
        max_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        num_generations=k,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        pass_threshold=args.eval_pass_threshold,
        seed=args.seed,
    )


def _figure(metrics: dict, key: str) -> str:
    value = metrics.get(key)
    if value is None or math.isnan(value):
        return "-"
    low, high = metrics.get(f"{key}_ci_low"), metrics.get(f"{key}_ci_high")
    return f"{value:.3f}" + ("" if low is None else f" [{low:.3f}, {high:.3f}]")


def table_lines(metrics: dict, reward_names: list[str], k: int) -> list[str]:
    """One line per reward: greedy, mean@K and each pass@k with its interval."""
    keys = ["greedy", f"mean@{k}", *(f"pass@{j}" for j in ks_up_to(k))]
    width = max(len(n) for n in reward_names)
    return [
        f"  {name:<{width}}  " + "  ".join(f"{key} {_figure(metrics, f'{name}/{key}')}" for key in keys)
        for name in reward_names
    ]


def score_and_report(engine, template, rows: list[dict], runner, args, model: str, output: OutputFile) -> EvalResult:
    """Score ``rows`` as ``args`` asks, print the result and write it to ``output`` (``--output``, probed at the
    start) if given; progress lines on stderr while it generates (runs/progress.py)."""
    with EvalProgress() as progress:
        return _score_and_report(engine, template, rows, runner, args, model, output, progress)


def _score_and_report(engine, template, rows, runner, args, model: str, output: OutputFile, progress) -> EvalResult:
    settings = replace(eval_settings(args), progress=progress)
    names = list(args.reward_funcs)
    if settings.num_generations:
        result = evaluate_policy(engine, template, rows, runner, names, settings)
        print(
            f"{model} on {args.dataset} ({len(rows)} prompts; greedy, and {settings.num_generations} samples per "
            f"prompt at temperature {settings.temperature:g}; a sample passes at reward >= "
            f"{settings.pass_threshold:g}; [95% interval over prompts]):",
            flush=True,
        )
        print("\n".join(table_lines(result.metrics, names, settings.num_generations)), flush=True)
    else:
        result = evaluate_rows(
            engine,
            template,
            rows,
            runner,
            names,
            args.max_new_tokens,
            temperature=args.temperature,
            batch_size=args.batch_size,
            progress=progress,
        )
        scores = ", ".join(f"{k} {v:.3f}" for k, v in result.metrics.items())
        print(
            f"{model} on {args.dataset} ({len(rows)} prompts, {'greedy' if args.temperature == 0 else 'sampled'}): "
            f"{scores}",
            flush=True,
        )
    if output.path is not None:
        head = json.dumps({"model": model, "dataset": args.dataset, **result.metrics}) + "\n"
        output.write([head, *(jsonl_line(row) for row in [*result.rows, *result.sampled_rows])])
        if settings.num_generations:
            print(f"wrote {args.output}", flush=True)
    return result
