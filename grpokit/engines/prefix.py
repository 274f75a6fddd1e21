"""Completion logits with each distinct prompt computed once.

The ``num_generations`` completions of a group share their prompt, and prompts are often longer than the
completions (system prompt, instructions). The plain forward recomputes the prompt once per completion. Here the
distinct prompts of a batch run once (with gradient), their KV cache is indexed out to every row, and only the
completion tokens run per row. Autograd flows through the cache, so values and gradients equal the plain forward's
(up to floating-point summation order) — a test checks both.

``completion_logits(..., head=ChunkedHead)`` runs the same forwards with the output head swapped for chunked logps
(engines/chunked_head.py): the results per completion token come back in the logits' place, never the logits.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch

# Below this size the extra prompt-only forward costs more than it saves: measured here, a 0.5M-parameter model
# sampled 1.56x raw HF speed without sharing and 1.06x with it; SmolLM2-135M went from 0.95x to 1.25x with it.
SHARE_MIN_PARAMS = 10_000_000


def worth_sharing(model) -> bool:
    """Whether computing distinct prompts once pays off for a model of this size."""
    return sum(p.numel() for p in model.parameters()) >= SHARE_MIN_PARAMS


def _first_occurrence(inverse: torch.Tensor, n_unique: int) -> torch.Tensor:
    rows = torch.arange(inverse.numel(), device=inverse.device)
    first = torch.full((n_unique,), inverse.numel(), dtype=torch.long, device=inverse.device)
    return first.scatter_reduce(0, inverse, rows, reduce="amin")


def shared_prompts(input_ids: torch.Tensor, logits_to_keep: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first row of each distinct prompt [U], row → distinct prompt [B]) when sharing saves work, else None."""
    prompt_len = input_ids.shape[1] - logits_to_keep
    if prompt_len <= 0:
        return None
    uniq, inverse = torch.unique(input_ids[:, :prompt_len], dim=0, return_inverse=True)
    if 2 * len(uniq) > input_ids.shape[0]:  # fewer than two rows per prompt on average: not worth it
        return None
    return _first_occurrence(inverse, len(uniq)), inverse


def completion_logits(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    logits_to_keep: int,
    share_prompts: bool = True,
    head=None,
    **model_kwargs,
) -> torch.Tensor:
    """Logits [B, C, V] at the positions that predict the last C = ``logits_to_keep`` tokens; with ``head`` (a
    ``ChunkedHead``), its per-token results [B, C, k] for those tokens instead, computed in the head's place."""
    c = logits_to_keep
    plan = shared_prompts(input_ids, c) if share_prompts and position_ids is not None else None  # None: the
    # model derives positions itself (vision-language models), which a prompt-only forward would get wrong
    if plan is None:
        with swapped_head(head, next_tokens(input_ids, c + 1)) as take:
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                logits_to_keep=c + 1,
                use_cache=False,
                **model_kwargs,
            )
        return take(out)[:, :-1, :]
    first, inverse = plan
    cache_kw = cache_kwarg(model)
    p = input_ids.shape[1] - c
    with swapped_head(head, input_ids[:, p : p + 1], rows=inverse) as take:  # per row: its prompt's last position
        head_out = model(
            input_ids=input_ids[first, :p],
            attention_mask=attention_mask[first, :p],
            position_ids=position_ids[first, :p],
            use_cache=True,
            logits_to_keep=1,
            **model_kwargs,
        )
    first_logits = take(head_out) if head is not None else head_out.logits[inverse]
    cache = _output_cache(head_out)
    cache.batch_select_indices(inverse)  # every row gets its prompt's keys/values (differentiable indexing)
    with swapped_head(head, next_tokens(input_ids, c)) as take:
        tail = model(
            input_ids=input_ids[:, p:],
            attention_mask=attention_mask,
            position_ids=position_ids[:, p:],
            use_cache=True,
            logits_to_keep=c,
            **{cache_kw: cache},
            **model_kwargs,
        )
    return torch.cat([first_logits, take(tail)[:, :-1, :]], dim=1)


def next_tokens(input_ids: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n]: the token each of the last ``n`` positions predicts (0 after the last token, a result dropped)."""
    return torch.nn.functional.pad(input_ids[:, input_ids.shape[1] - n + 1 :], (0, 1))


@contextmanager
def swapped_head(head, targets: torch.Tensor, rows: torch.Tensor | None = None):
    """``head.swap`` when a ChunkedHead is given, else a block whose ``take(out)`` is ``out.logits``."""
    if head is None:
        yield lambda out: out.logits
    else:
        with head.swap(targets, rows) as take:
            yield take


def prefill_shared_prompts(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """For generation: a KV cache of every row's prompt but its last token, each distinct prompt computed once
    (None when prompts are mostly distinct). ``generate(..., cache=it)`` then starts from the last token."""
    plan = shared_prompts(input_ids, 1)
    if plan is None:
        return None
    first, inverse = plan
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids[first, :-1],
        attention_mask=attention_mask[first, :-1],
        position_ids=position_ids[first, :-1],
        use_cache=True,
        logits_to_keep=1,
    )
    cache = _output_cache(out)
    cache.batch_select_indices(inverse)
    return cache


def cache_kwarg(model) -> str:
    """transformers ≥ 5.2x names the cache argument ``cache``; older versions ``past_key_values``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _output_cache(out):
    """The KV cache of a model output (``cache`` in transformers ≥ 5.2x, ``past_key_values`` before)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
