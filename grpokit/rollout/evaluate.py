"""Evaluation on held-out rows, scored by the reward functions; used by the trainer's ``--eval_steps``, by
``grpokit infer`` and by ``grpokit eval``.

``evaluate_rows`` is one pass (greedy by default) and the mean score per function. ``evaluate_policy`` is the
evaluation a run reports: that greedy pass (``<reward>/greedy``) and, with ``num_generations`` K, K sampled
completions per prompt at the run's sampling settings, reported as ``<reward>/pass@k`` (k = 1, 2, 4, … and K),
``<reward>/mean@K`` and their 95 % intervals (``_ci_low`` / ``_ci_high``; algorithms/pass_at_k.py says how).
A sample passes when its score ≥ ``pass_threshold`` (1.0: a correct answer of an accuracy-type reward).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grpokit.algorithms.pass_at_k import sampled_metrics
from grpokit.protocol import RequestConfig, RolloutInferRequest


@dataclass
class EvalResult:
    metrics: dict[str, float]
    rows: list[dict] = field(default_factory=list)  # one per prompt: the (greedy) completion and its scores
    sampled_rows: list[dict] = field(default_factory=list)  # K per prompt, with ``sample`` 0..K-1


@dataclass(frozen=True)
class EvalSettings:
    """How ``evaluate_policy`` generates: ``num_generations`` None (or 0) is the greedy pass alone."""

    max_tokens: int
    batch_size: int = 64  # prompts per engine call
    num_generations: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    pass_threshold: float = 1.0
    seed: int | None = None  # the sampled pass's seed (the same samples at every evaluation of the same weights)
    progress: Callable[[str, int, int], None] | None = None  # (pass, prompts done, prompts): after each engine call

    @classmethod
    def for_run(cls, cfg) -> EvalSettings:
        """A training run's settings: its sampling options, ``--num_generations_eval``, ``--eval_pass_threshold``
        and ``--per_device_eval_batch_size`` (``cfg`` a ``TrainConfig``, read by attribute)."""
        r, t = cfg.rollout, cfg.training
        return cls(
            max_tokens=r.max_completion_length,
            batch_size=t.per_device_eval_batch_size,
            num_generations=t.num_generations_eval,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            repetition_penalty=r.repetition_penalty,
            pass_threshold=t.eval_pass_threshold,
            seed=t.seed,
        )


def _complete(
    engine, template, rows: list[dict], config: RequestConfig, batch_size: int, progress=None, label: str = "greedy"
) -> tuple[list, list]:
    """``config.n`` completions per row, row after row: (texts, finish reasons), each of length len(rows)·n;
    ``progress(label, prompts done, prompts)`` before the first engine call and after each."""
    completions: list[str] = []
    finish: list[str] = []
    for start in range(0, len(rows), batch_size):
        if progress is not None:
            progress(label, start, len(rows))
        chunk = rows[start : start + batch_size]
        reqs = [
            RolloutInferRequest(
                messages=template.with_system(r["messages"]),  # the row's columns (its images)
                data_dict={k: v for k, v in r.items() if k != "messages"},
            )
            for r in chunk
        ]
        call = config if config.seed is None else config.model_copy(update={"seed": config.seed + start})
        for resp in engine.infer(reqs, call):
            completions.extend(c.message["content"] for c in resp.choices)
            finish.extend(c.finish_reason for c in resp.choices)
    if progress is not None:
        progress(label, len(rows), len(rows))
    return completions, finish


def _score(
    rows: list[dict], completions: list[str], finish: list[str], reward_runner, trainer_state: dict | None
) -> torch.Tensor:
    """[len(completions), F] scores; ``rows`` is one row per completion."""
    columns = {k for r in rows for k in r if k != "messages"}
    kwargs = {c: [r.get(c) for r in rows] for c in columns}
    kwargs.update(
        messages=[[*r["messages"], {"role": "assistant", "content": c}] for r, c in zip(rows, completions)],
        finish_reason=finish,
        is_truncated=[f == "length" for f in finish],
        trainer_state=trainer_state or {"global_step": 0, "max_steps": 0},
        rollout_infos=[{}] * len(rows),
        num_turns=[1] * len(rows),
    )
    return reward_runner.compute(completions, kwargs) if reward_runner else torch.zeros(len(rows), 0)


def _out_rows(
    rows: list[dict], completions: list[str], scores: torch.Tensor, reward_names: list[str], n: int | None = None
) -> list[dict]:
    extra = (lambda i: {}) if n is None else (lambda i: {"sample": i % n})
    return [
        {
            "prompt": r["messages"][-1]["content"],
            "completion": c,
            **extra(i),
            **{name: (None if s != s else float(s)) for name, s in zip(reward_names, scores[i].tolist())},
        }
        for i, (r, c) in enumerate(zip(rows, completions))
    ]


def evaluate_rows(
    engine,
    template,
    rows: list[dict],
    reward_runner,
    reward_names: list[str],
    max_tokens: int,
    temperature: float = 0.0,
    batch_size: int = 64,
    trainer_state: dict | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> EvalResult:
    """Greedy (or sampled) completions for ``rows`` scored by the reward functions; mean score per function.
    ``trainer_state`` is what rewards read as ``trainer_state.global_step`` (the trainer's step; 0 outside one)."""
    config = RequestConfig(n=1, max_tokens=max_tokens, temperature=temperature)
    completions, finish = _complete(engine, template, rows, config, batch_size, progress)
    scores = _score(rows, completions, finish, reward_runner, trainer_state)
    metrics = {}
    for j, name in enumerate(reward_names[: scores.shape[1]]):
        col = scores[:, j]
        metrics[name] = float(col[~col.isnan()].mean()) if (~col.isnan()).any() else float("nan")
    return EvalResult(metrics, _out_rows(rows, completions, scores, reward_names))


def _fork_rng():
    """The sampled pass seeds the engine; the training's random stream must not see it (torch's global generator
    and the current GPU's are restored afterwards)."""
    return torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else [])


def evaluate_policy(
    engine,
    template,
    rows: list[dict],
    reward_runner,
    reward_names: list[str],
    settings: EvalSettings,
    trainer_state: dict | None = None,
) -> EvalResult:
    """The greedy pass (``<reward>/greedy``), then with ``settings.num_generations`` K the sampled one:
    ``<reward>/pass@k``, ``<reward>/mean@K`` and their intervals, per reward function."""
    greedy = evaluate_rows(
        engine,
        template,
        rows,
        reward_runner,
        reward_names,
        settings.max_tokens,
        batch_size=settings.batch_size,
        trainer_state=trainer_state,
        progress=settings.progress,
    )
    metrics = {f"{name}/greedy": value for name, value in greedy.metrics.items()}
    k = settings.num_generations
    if not k:
        return EvalResult(metrics, greedy.rows)
    config = RequestConfig(
        n=k,
        max_tokens=settings.max_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        top_k=settings.top_k,
        repetition_penalty=settings.repetition_penalty,
        seed=settings.seed,
    )
    with _fork_rng():
        completions, finish = _complete(
            engine, template, rows, config, settings.batch_size, settings.progress, f"{k} samples each"
        )
    repeated = [r for r in rows for _ in range(k)]
    scores = _score(repeated, completions, finish, reward_runner, trainer_state)  # [P·K, F]
    for j, name in enumerate(reward_names[: scores.shape[1]]):
        table = sampled_metrics(scores[:, j].double().view(len(rows), k).tolist(), settings.pass_threshold)
        metrics.update({f"{name}/{key}": value for key, value in table.items()})
    return EvalResult(metrics, greedy.rows, _out_rows(repeated, completions, scores, reward_names, k))
