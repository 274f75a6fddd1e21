"""The teachers of on-policy distillation (--teacher_model, --teacher_model_server; config/teacher_args.py): built
once at set-up, then, each window, the sampled tokens scored by each sample's teacher and the per-token term of
algorithms/distill.py added to the advantages.

A teacher scores exactly what the student's old logps score: the same token ids (never re-tokenised), the
rollout's temperature, the sampler's kept set rebuilt from the teacher's own logits by the same rule
(algorithms/kept_set.py), no gradient, in micro-batch chunks. An in-process teacher goes through the very routine
the reference model's logps go through (``WindowProducer._batched_logps``); a server teacher runs the same
routine on the server (server/score_route.py). With a ``teacher_prompt`` column the teacher sees that prompt in
place of the last user message (ms-swift's rule) and the same completion tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from grpokit.algorithms.distill import distill_advantages, teacher_kl_per_token
from grpokit.config.teacher_args import TEACHER_PROMPT, TeacherSpec, teacher_specs
from grpokit.distributed.processes import gather_rows
from grpokit.engines.teacher_client import TeacherServer
from grpokit.errors import ConfigError, DataError
from grpokit.modeling import load_trained, torch_dtype
from grpokit.trainers.batch import RolloutBatch, collate

logger = logging.getLogger(__name__)

LogpsOf = Callable[[Any, RolloutBatch], torch.Tensor]  # (model, batch) -> [N, C] logps, no grad, chunked


@dataclass
class Teacher:
    spec: TeacherSpec
    model: Any = None  # kind model: the loaded teacher; base/policy: the training model; server: None
    server: TeacherServer | None = None


class Teachers:
    """Every teacher of the run, the coefficient, the routing column, and what re-encoding a teacher prompt needs
    (the run's template and completion limit)."""

    def __init__(
        self,
        teachers: list[Teacher],
        coef: float,
        tag_key: str,
        template,
        temperature: float,
        policy,
        accelerator,
        completion_limit: int | None,
    ) -> None:
        self.teachers, self.coef, self.tag_key, self.template = teachers, coef, tag_key, template
        self.temperature, self.policy, self.accelerator = temperature, policy, accelerator
        self.completion_limit = completion_limit

    @classmethod
    def build(cls, cfg, accelerator, model, policy, template) -> Teachers | None:
        """The run's teachers (None without one): in-process ones loaded on this process's device, frozen; the
        base one under LoRA is the training ``model`` itself, its adapters switched off around each forward."""
        specs = teacher_specs(cfg.teacher, cfg.model.model, cfg.model.tuner_type == "lora")
        if not specs:
            return None
        teachers = [cls._one(s, cfg, accelerator, model, template) for s in specs]
        r = cfg.rollout
        limit = r.max_completion_length if r.completion_length_limit_scope == "total" else None
        return cls(
            teachers,
            cfg.teacher.teacher_kl_coef,
            cfg.teacher.teacher_tag_key,
            template,
            r.temperature,
            policy,
            accelerator,
            limit,
        )

    @staticmethod
    def _one(spec: TeacherSpec, cfg, accelerator, model, template) -> Teacher:
        if spec.kind == "server":
            return Teacher(spec, server=TeacherServer(spec.source, timeout=cfg.rollout.vllm_server_timeout))
        if spec.kind == "base":
            return Teacher(spec, model=model)
        dtype = torch_dtype(cfg.model.torch_dtype, for_training_weights=False)
        teacher = load_trained(spec.source, dtype, trust_remote_code=cfg.model.trust_remote_code)  # or an adapter
        vocab = teacher.get_output_embeddings().weight.shape[0]
        if len(template.tokenizer) > vocab:
            raise ConfigError(
                f"--teacher_model {spec.source}: its vocabulary ({vocab}) is smaller than the "
                f"student's tokenizer ({len(template.tokenizer)}); distillation scores the student's "
                "token ids, so the teacher needs the same tokenizer"
            )
        teacher.to(accelerator.device).eval().requires_grad_(False)
        return Teacher(spec, model=teacher)

    # -- each window --------------------------------------------------------------------------------------------------
    def apply(
        self, batch: RolloutBatch, rows: list[dict], logps_of: LogpsOf, metrics: dict
    ) -> tuple[torch.Tensor, dict]:
        """Per-token advantages [N, C] for ``batch`` (its per-sequence advantages and old logps set), and
        ``metrics`` with teacher_kl and per teacher ``teacher/<name>/kl`` added (means over every process)."""
        if batch.old_logps is None or torch.isnan(batch.old_logps).any():
            raise ConfigError(
                "on-policy distillation needs the rollout policy's logps of every row; a "
                "_prepare_batch_inputs override left them out"
            )
        mask = batch.completion_mask
        owner = self.route(rows)
        teacher = self.score(batch, rows, owner, logps_of)
        out = distill_advantages(batch.advantages, teacher, batch.old_logps, mask, self.coef)
        k3 = teacher_kl_per_token(teacher, batch.old_logps, mask)
        new = {"teacher_kl": self._global_mean(k3, mask)[0]}
        if len(self.teachers) > 1:  # each teacher's own gauge, where the window held rows of it
            for t, spec in enumerate(t.spec for t in self.teachers):
                value, tokens = self._global_mean(k3, mask * (owner == t).unsqueeze(1).to(mask.dtype))
                if tokens:
                    new[f"teacher/{spec.name}/kl"] = value
        return out.advantages.float(), {**metrics, **new}

    def _global_mean(self, x, mask) -> tuple[float, float]:
        """(mean of ``x`` over the tokens ``mask`` keeps on every process, how many tokens those are)."""
        local = torch.stack([torch.where(mask > 0, x, 0.0).sum(), (mask > 0).sum().to(x.dtype)]).unsqueeze(0)
        total = gather_rows(self.accelerator, local.float()).sum(0)
        return float(total[0] / total[1].clamp(min=1)), float(total[1])

    def route(self, rows: list[dict]) -> torch.Tensor:
        """[N] the index of each row's teacher: the one teacher, else the one whose tags hold its tag column."""
        if len(self.teachers) == 1:
            return torch.zeros(len(rows), dtype=torch.long)
        by_tag = {tag: i for i, t in enumerate(self.teachers) for tag in t.spec.tags}
        owner = []
        for row in rows:
            tag = row.get(self.tag_key)
            if tag is None or str(tag) not in by_tag:
                raise DataError(
                    f"--teacher_tag_key {self.tag_key}: a row's value {tag!r} is no teacher's tag; "
                    f"the tags are {sorted(by_tag)} (give every row one of them)"
                )
            owner.append(by_tag[str(tag)])
        return torch.tensor(owner, dtype=torch.long)

    def score(self, batch: RolloutBatch, rows: list[dict], owner: torch.Tensor, logps_of: LogpsOf) -> torch.Tensor:
        """[N, C] the sampled tokens' logps under each row's teacher (0 outside the completion mask)."""
        seen = self.teacher_view(batch, rows)
        out = torch.zeros_like(batch.completion_mask)
        for t, teacher in enumerate(self.teachers):
            idx = (owner == t).nonzero().flatten()
            if len(idx):
                lp = self._score_one(teacher, seen.select(idx), logps_of)
                out[idx, : lp.shape[1]] = lp
        return torch.where(batch.completion_mask > 0, out, 0.0)

    def _score_one(self, teacher: Teacher, sub: RolloutBatch, logps_of: LogpsOf) -> torch.Tensor:
        if teacher.server is not None:
            prompts, completions = _ids(sub)
            rows = teacher.server.score(prompts, completions, self.temperature, sub.sampler_support)
            out = torch.zeros_like(sub.completion_mask)
            for i, row in enumerate(rows):
                out[i, : len(row)] = torch.tensor(row, dtype=out.dtype)
            return out
        if teacher.spec.kind == "base":
            with self.policy.disable_adapter():  # LoRA: the base model is the teacher, no second copy
                return logps_of(teacher.model, sub)
        return logps_of(teacher.model, sub)

    def teacher_view(self, batch: RolloutBatch, rows: list[dict]) -> RolloutBatch:
        """``batch`` itself, or with a ``teacher_prompt`` column the rows re-encoded with that prompt in place of
        the last user message; the completion tokens and their frame stay the student's."""
        prompts = [row.get(TEACHER_PROMPT) for row in rows]
        if not any(prompts):
            return batch
        samples = []
        for row, prompt in zip(rows, prompts, strict=True):
            out, req = row["_output"], row["_request"]
            messages = out.prompt_messages or req.messages
            samples.append(self.template.encode_output(_with_prompt(messages, prompt) if prompt else messages, out))
        seen = collate(
            samples, self.template.pad_token_id, [bool(r["is_truncated"]) for r in rows], self.completion_limit
        )
        if seen.completion_mask.shape != batch.completion_mask.shape:
            raise DataError(
                "teacher_prompt: the re-encoded rows' completions differ from the student's; a "
                "multi-turn trajectory cannot take a teacher prompt"
            )
        seen.sampler_support = batch.sampler_support
        return seen


def _with_prompt(messages: list[dict], prompt) -> list[dict]:
    """``messages`` with the last user message's content replaced by ``prompt`` (ms-swift's teacher view)."""
    if not isinstance(prompt, str):
        raise DataError(f"the {TEACHER_PROMPT} column must hold text, got {type(prompt).__name__}")
    out = [dict(m) for m in messages]
    for m in reversed(out):
        if m.get("role") == "user":
            m["content"] = prompt
            return out
    raise DataError(f"a row with a {TEACHER_PROMPT} has no user message to replace")


def _ids(batch: RolloutBatch) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's prompt ids and completion ids, without padding."""
    c = batch.logits_to_keep
    prompts, completions = [], []
    for ids, att in zip(batch.input_ids.tolist(), batch.attention_mask.tolist(), strict=True):
        prompts.append([t for t, a in zip(ids[:-c], att[:-c], strict=True) if a])
        completions.append([t for t, a in zip(ids[-c:], att[-c:], strict=True) if a])
    return prompts, completions
