"""`grpokit train`'s reward options (the RewardArguments slice of config/args.py): the reward functions, models and
plugins, and the built-in rewards' knobs."""

from __future__ import annotations

from dataclasses import dataclass

from grpokit.config.fields import opt as _opt

ISOLATION_MODES = ("bwrap", "none")  # --code_exec_isolation's choices (grpokit/rewards/isolation.py runs them)


@dataclass
class RewardArguments:
    reward_funcs: list[str] = _opt([], "reward functions from the orms registry (default: accuracy)")
    reward_weights: list[float] = _opt([], "one weight per reward function, then per reward model (default 1)")
    reward_model: list[str] = _opt([], "reward model folder(s) (sequence classification, frozen)")
    reward_model_plugin: list[str] = _opt([], "rm_plugins name per reward model (default: default)")
    external_plugins: list[str] = _opt([], "python files imported before anything is looked up")
    cosine_min_len_value_wrong: float = _opt(-0.5, "cosine reward: value for a short wrong answer")
    cosine_max_len_value_wrong: float = _opt(0.0, "cosine reward: value for a long wrong answer")
    cosine_min_len_value_correct: float = _opt(1.0, "cosine reward: value for a short correct answer")
    cosine_max_len_value_correct: float = _opt(0.5, "cosine reward: value for a long correct answer")
    cosine_max_len: int | None = _opt(None, "cosine reward: length scale (default max_completion_length)", ge=1)
    repetition_n_grams: int = _opt(3, "repetition reward: n-gram size", ge=1)
    repetition_max_penalty: float = _opt(-1.0, "repetition reward: most negative value", le=0)
    soft_max_length: int | None = _opt(None, "soft_overlong reward: max length (default max_completion_length)", ge=1)
    soft_cache_length: int | None = _opt(None, "soft_overlong reward: soft penalty window", ge=0)
    code_exec_timeout: float = _opt(5.0, "code_exec reward: seconds per sample, across all its test cases", gt=0)
    code_exec_memory_mb: int = _opt(512, "code_exec reward: memory limit per program", ge=1)
    code_exec_workers: int = _opt(2, "code_exec reward: programs run in parallel", ge=1)
    code_exec_isolation: str = _opt(
        "bwrap",
        "code_exec reward: bwrap (each program in a bubblewrap sandbox with "
        "seccomp; refuses to start without it) or none (UNSAFE: no isolation, "
        "warned at every start)",
    )
    reward_timeout: float | None = _opt(
        None,
        "seconds one reward function may take on a batch (sync rewards then run "
        "in a worker thread, async ones under asyncio's timeout); past it the "
        "run stops with a reward error naming the function; unset: no limit "
        "(a 'still running' line every 30 s either way)",
        gt=0,
    )
