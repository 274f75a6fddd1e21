"""``POST /score_tokens/``: the served model's log-probabilities of given tokens (a distillation teacher's scores;
engines/teacher_client.py is its client, trainers/teachers.py its caller).

The body names each sequence by ids (prompt, completion), the temperature and the sampler's kept set; the answer
is one logprob per completion token, computed by the trainer's own routine (trainers/packing.py's
``completion_logps``: logits divided by the temperature, renormalised over the kept set) under no_grad, a few
rows at a time, with the engine's lock held so that no weight update lands mid-forward. Every bound is checked
first: the number of sequences, each one's length against the context, every id against the vocabulary.
"""

from __future__ import annotations

import asyncio

import torch
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from grpokit.algorithms.kept_set import SamplerSupport
from grpokit.protocol import MAX_TEMPERATURE, MAX_TOKENS, MAX_TOP_K, MIN_TEMPERATURE
from grpokit.template.encode import EncodedSample
from grpokit.trainers.batch import collate
from grpokit.trainers.forward import model_kwargs
from grpokit.trainers.packing import ForwardOptions, completion_logps

ROWS_PER_FORWARD = 8
_STRICT = ConfigDict(extra="forbid")


class ScoreSupport(BaseModel):
    model_config = _STRICT
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)
    top_p: float = Field(1.0, gt=0, le=1)
    min_p: float = Field(0.0, ge=0, lt=1)
    blocked: list[int] = Field(default_factory=list, max_length=4096)


class ScoreSequence(BaseModel):
    model_config = _STRICT
    prompt_ids: list[int] = Field(min_length=1, max_length=MAX_TOKENS)
    completion_ids: list[int] = Field(min_length=1, max_length=MAX_TOKENS)


class ScoreBody(BaseModel):
    model_config = _STRICT
    sequences: list[ScoreSequence] = Field(min_length=1, max_length=4096)
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE)
    support: ScoreSupport | None = None


def add_score_route(app: FastAPI, state) -> None:
    @app.post("/score_tokens/")
    async def score_tokens(body: ScoreBody) -> dict:
        """One logprob per completion token of each sequence (docs/algorithms.md, "On-policy distillation")."""
        engine = state.engine
        model = getattr(engine, "model", None)
        if model is None or not hasattr(engine, "lock"):
            raise HTTPException(
                501,
                f"the {state.options.engine} engine cannot score given tokens; serve the "
                "teacher with `grpokit rollout --engine transformers`",
            )
        _check_bounds(body, engine, state.options.max_batch_requests)

        def run() -> list[list[float]]:
            with engine.lock:
                return score(model, engine.template.pad_token_id, body)

        return {"logprobs": await asyncio.to_thread(run)}


def _check_bounds(body: ScoreBody, engine, max_rows: int) -> None:
    if len(body.sequences) > max_rows:
        raise HTTPException(413, f"{len(body.sequences)} sequences; this server takes at most {max_rows} per call")
    vocab = engine.model.get_output_embeddings().weight.shape[0]
    context = getattr(engine, "max_model_len", None)
    for i, s in enumerate(body.sequences):
        n = len(s.prompt_ids) + len(s.completion_ids)
        if context is not None and n > context:
            raise HTTPException(400, f"sequences[{i}]: {n} tokens exceed the served context of {context}")
        if min(*s.prompt_ids, *s.completion_ids) < 0 or max(*s.prompt_ids, *s.completion_ids) >= vocab:
            raise HTTPException(400, f"sequences[{i}]: a token id outside the vocabulary [0, {vocab})")
    if body.support is not None and any(not 0 <= t < vocab for t in body.support.blocked):
        raise HTTPException(400, f"support.blocked: a token id outside the vocabulary [0, {vocab})")


@torch.no_grad()
def score(model, pad_id: int, body: ScoreBody) -> list[list[float]]:
    """The completion tokens' logprobs, ``ROWS_PER_FORWARD`` sequences per forward."""
    s = body.support
    vocab = model.get_output_embeddings().weight.shape[0]  # a top-k past the vocabulary keeps all of it
    support = None if s is None else SamplerSupport(min(s.top_k, vocab), s.top_p, s.min_p, tuple(s.blocked))
    support = support if support is not None and support.truncates else None
    opts = ForwardOptions(temperature=body.temperature, chunk_size=0, padding_free=False, share_prompts=False)
    device = next(model.parameters()).device
    out: list[list[float]] = []
    for start in range(0, len(body.sequences), ROWS_PER_FORWARD):
        rows = body.sequences[start : start + ROWS_PER_FORWARD]
        samples = [EncodedSample(r.prompt_ids, r.completion_ids, [1] * len(r.completion_ids)) for r in rows]
        batch = collate(samples, pad_id, [False] * len(rows)).to(device)
        lp, _ = completion_logps(model, model_kwargs(batch, model.dtype), batch.logits_to_keep, opts, False, support)
        out += [lp[i, : len(r.completion_ids)].float().tolist() for i, r in enumerate(rows)]
    return out
