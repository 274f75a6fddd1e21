"""`grpokit train`'s teacher options (on-policy distillation, ms-swift's OPD-RL; algorithms/distill.py): which
teacher scores the sampled tokens, how much its log-ratio weighs, and how samples are routed among several.

``teacher_specs`` turns the options into a list of ``TeacherSpec`` (torch-free, checked at parse time), so that
every bad combination is one line before anything loads."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from grpokit.config.fields import opt as _opt
from grpokit.errors import ConfigError

TEACHER_PROMPT = "teacher_prompt"  # the dataset column holding the teacher's prompt (ms-swift's name)


@dataclass
class TeacherArguments:
    teacher_model: str | None = _opt(
        None,
        "on-policy distillation: the teacher's model folder (the student's tokenizer), scored in this process; "
        "the --model folder itself with --tuner_type lora: the base model, adapters disabled (no second "
        'copy); or a JSON list [{"model": FOLDER, "tags": [...]}, ...] routed by --teacher_tag_key',
    )
    teacher_model_server: str | None = _opt(
        None,
        "on-policy distillation: the URL of a `grpokit rollout` server holding the teacher (it scores the "
        'sampled tokens, POST /score_tokens/); or a JSON list [{"url": URL, "tags": [...]}, ...] routed '
        "by --teacher_tag_key",
    )
    teacher_kl_coef: float = _opt(
        1.0,
        "on-policy distillation: c in A_t = A + c·(log π_teacher(y_t) − log π_old(y_t)), added to each "
        "completion token's advantage after the group normalisation",
        ge=0,
    )
    teacher_tag_key: str = _opt(
        "dataset", "several teachers: the dataset column whose value (a teacher's tag) picks each sample's teacher"
    )


@dataclass(frozen=True)
class TeacherSpec:
    """One teacher: ``kind`` model (a folder loaded here), server (a URL), base (the policy's base under LoRA,
    adapters disabled) or policy (the current policy itself, on the ``teacher_prompt`` column: ms-swift's dynamic
    self-distillation); ``tags``: the --teacher_tag_key values it takes (empty: every sample)."""

    kind: str
    source: str
    tags: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The metrics' name for it: its first tag, else its kind."""
        return self.tags[0] if self.tags else self.kind


def teacher_specs(t: TeacherArguments, model: str | None, lora: bool) -> list[TeacherSpec]:
    """The teachers the options name (empty: none). ``model``: --model, ``lora``: --tuner_type lora."""
    if t.teacher_model is not None and t.teacher_model_server is not None:
        raise ConfigError(
            "--teacher_model and --teacher_model_server are both set; give one (for several teachers "
            "of one kind, a JSON list in that option)"
        )
    if t.teacher_model_server is not None:
        return _parsed("--teacher_model_server", t.teacher_model_server, "url", "server")
    if t.teacher_model is None:
        return []
    specs = _parsed("--teacher_model", t.teacher_model, "model", "model")
    same = [s for s in specs if model is not None and _same_path(s.source, model)]
    if same and lora:  # ms-swift: the base model through disabled adapters, no second copy
        return [TeacherSpec("base", s.source, s.tags) if s in same else s for s in specs]
    return specs


def _parsed(option: str, text: str, key: str, kind: str) -> list[TeacherSpec]:
    text = text.strip()
    if not text:
        raise ConfigError(f'{option} is empty; give a {key} or a JSON list of {{"{key}": ..., "tags": [...]}}')
    if not text.startswith("["):
        return [TeacherSpec(kind, text)]
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f'{option}: not valid JSON ({e.msg} at character {e.pos}); write [{{"{key}": ..., "tags": ["..."]}}, ...]'
        ) from None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f'{option}: a JSON list of one or more {{"{key}": ..., "tags": [...]}} is needed')
    specs, seen = [], {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get(key), str) or not entry[key].strip():
            raise ConfigError(f'{option}[{i}]: each entry is an object with a non-empty "{key}" string')
        extra = set(entry) - {key, "tags"}
        if extra:
            raise ConfigError(f'{option}[{i}]: unknown key(s) {sorted(extra)}; an entry has "{key}" and "tags"')
        tags = entry.get("tags", [])
        if not isinstance(tags, list) or not all(isinstance(x, str | int) and str(x) for x in tags):
            raise ConfigError(f'{option}[{i}]: "tags" must be a list of strings')
        tags = tuple(str(x) for x in tags)
        if len(entries) > 1 and not tags:
            raise ConfigError(
                f"{option}[{i}] has no tags; with several teachers each one needs the --teacher_tag_key values it takes"
            )
        for tag in tags:
            if tag in seen:
                raise ConfigError(
                    f"{option}: tag {tag!r} belongs to teacher {seen[tag]} and {i}; each tag names one teacher"
                )
            seen[tag] = i
        specs.append(TeacherSpec(kind, entry[key].strip(), tags))
    return specs


def _same_path(a: str, b: str) -> bool:
    return os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b))


def check_teacher_options(cfg) -> None:
    """The teacher options against the rest of the run (``cfg``: a TrainConfig), one line per problem."""
    specs = teacher_specs(cfg.teacher, cfg.model.model, cfg.model.tuner_type == "lora")
    if not specs:
        return
    for spec in specs:
        if spec.kind == "server" and not spec.source.startswith(("http://", "https://")):
            raise ConfigError(
                f"--teacher_model_server {spec.source}: not an http(s) URL; give the teacher server's "
                "base URL, e.g. http://127.0.0.1:8000"
            )
        if spec.kind == "model" and not os.path.isdir(spec.source):
            raise ConfigError(f"--teacher_model {spec.source}: no such folder; give a local Hugging Face model folder")
    a, w = cfg.algorithm, cfg.reward
    if a.loss_type in ("real", "luspo"):
        raise ConfigError(
            f"--loss_type {a.loss_type} with a teacher: its loss needs one advantage per sequence, and "
            "the teacher's term is per token; use grpo, bnpo, dr_grpo, dapo, cispo, sapo or vespo"
        )
    pure = not (w.reward_funcs or w.reward_model or cfg.rollout.use_gym_env)
    if pure and a.dynamic_sample:
        raise ConfigError(
            "--dynamic_sample with a teacher and no --reward_funcs: pure distillation has no reward "
            "spread to filter groups by; add a reward function or drop --dynamic_sample"
        )
    if pure and a.scale_rewards == "gdpo":
        raise ConfigError(
            "--scale_rewards gdpo with a teacher and no --reward_funcs: pure distillation has no "
            "rewards to normalise; add a reward function or use another --scale_rewards"
        )
