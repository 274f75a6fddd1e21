"""The training forward with each distinct prompt run once and no padding computed: one packed row.

Prompt sharing (engines/prefix.py) runs a group's prompt once, then every completion row against its prompt's
cached keys and values; but the rows are right-padded to the longest completion, and that padding runs through
the model and the head like real tokens. When completions end at very different lengths (a typical GRPO batch),
much of the tail is padding. Here one row holds every distinct prompt's real tokens, then every completion's real
tokens, and a 4D mask (transformers uses a 4D mask as given) lets a prompt token see its prompt up to itself and a
completion token its whole prompt and its own completion up to itself. One forward, so each weight is read once
and gets one gradient (the cached path's prompt and tail forwards each make one, summed by autograd). The logps
and gradients are the padded path's up to floating-point summation order; padded positions get 0 (the completion
mask leaves them out).

It applies where such a mask means the same thing: sdpa or eager attention, no sliding window, no model inputs
besides the token ids, the mask and the positions, the chunked head, every row with a prompt token and its
completion's real tokens first; and where it costs less than the padded path (``worth_packing``).
"""

from __future__ import annotations

import torch

from grpokit.engines.chunked_head import inner_model
from grpokit.engines.prefix import swapped_head

MASK_ATTENTION = ("sdpa", "eager")  # attention implementations that read a 4D mask as given


def packable(model, model_inputs: dict, logits_to_keep: int) -> bool:
    """Whether the packed row computes what the padded prompt-sharing path computes for this batch."""
    if set(model_inputs) - {"input_ids", "attention_mask", "position_ids"} or model_inputs["position_ids"] is None:
        return False
    config = _base(model).config
    if getattr(config, "_attn_implementation", None) not in MASK_ATTENTION:
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        if any(t != "full_attention" for t in layer_types):
            return False
    elif getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return False
    mask = model_inputs["attention_mask"].bool()
    real = mask[:, -logits_to_keep:]
    if not mask[:, :-logits_to_keep].any(1).all():  # a row without a prompt token: nothing predicts its first
        return False
    return not bool((real[:, 1:] & ~real[:, :-1]).any())  # every row: its real tokens, then padding


def worth_packing(attention_mask: torch.Tensor, logits_to_keep: int, plan, hidden: int) -> bool:
    """Whether packing pays for this batch. Per layer a token costs about 12·H² multiply-adds in its linear layers
    and an attention pair (query, key) 4·H, so a forward costs about 3·H·tokens + pairs in units of 4·H. The packed
    row has N = the distinct prompts' real tokens + the real completion tokens, and N² pairs (its mask is
    computed whole); the padded path U·P + B·C tokens and U·P² + B·C·(P + C) pairs (U prompts of width P, B rows
    of width C). Packing runs where it costs less, and never with more than 4 times the padded path's attention
    pairs (the scores' memory)."""
    b, width = attention_mask.shape
    c, p, first = logits_to_keep, width - logits_to_keep, plan[0]
    n = int(attention_mask[first, :p].sum()) + int(attention_mask[:, p:].sum())
    padded_tokens, padded_pairs = len(first) * p + b * c, len(first) * p * p + b * c * (p + c)
    return 3 * hidden * n + n * n < 3 * hidden * padded_tokens + padded_pairs and n * n <= 4 * padded_pairs


def packed_group_logits(model, model_inputs: dict, logits_to_keep: int, head, plan) -> torch.Tensor:
    """The chunked head's per-token results [B, C, k] for the last C = ``logits_to_keep`` tokens, 0 at padded
    positions; ``plan``: (first row of each distinct prompt, row → prompt) from engines/prefix.shared_prompts.

    One packed row: every distinct prompt's real tokens, then every row's real completion tokens. A prompt token
    sees its prompt up to itself; a completion token sees its whole prompt and its own completion up to itself.
    The positions kept for the head are each prompt's last token (for the first completion token of each of its
    rows) and every completion token that has a next one."""
    input_ids, attention_mask, position_ids = (model_inputs[k] for k in ("input_ids", "attention_mask", "position_ids"))
    first, inverse = plan
    b, width = input_ids.shape
    c = logits_to_keep
    p = width - c
    pu, pj = attention_mask[first, :p].bool().nonzero(as_tuple=True)  # prompt by prompt, positions ascending
    rows, cols = attention_mask[:, p:].bool().nonzero(as_tuple=True)  # row by row, columns ascending
    n = len(pu)
    ids = torch.cat([input_ids[first, :p][pu, pj], input_ids[:, p:][rows, cols]])[None]
    positions = torch.cat([position_ids[first, :p][pu, pj], position_ids[:, p:][rows, cols]])[None]
    last = torch.bincount(pu, minlength=len(first)).cumsum(0) - 1  # each prompt's last token
    nxt = ((rows[1:] == rows[:-1]) & (cols[1:] == cols[:-1] + 1)).nonzero()[:, 0]  # completion tokens with a next
    keep = torch.cat([last[inverse], n + nxt])
    targets = torch.cat([input_ids[:, p], ids[0, n + nxt + 1]])[None]
    out_rows = torch.cat([torch.arange(b, device=rows.device), rows[nxt]])
    out_cols = torch.cat([torch.zeros(b, dtype=cols.dtype, device=cols.device), cols[nxt] + 1])
    mask = _group_mask(pu, inverse[rows], rows, model)
    with swapped_head(head, targets) as take:
        got = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=keep)
    results = take(got)[0]
    out = results.new_zeros(b, c, results.shape[-1])
    return out.index_put((out_rows, out_cols), results)


def _group_mask(prompt_of_prompt: torch.Tensor, prompt_of_row: torch.Tensor, rows: torch.Tensor, model):
    """[1, 1, N, N] over the packed row (prompt tokens first, then completion tokens; boolean for sdpa, additive
    for eager): same prompt, not later, and a completion key only from the query's own row."""
    prompt_of = torch.cat([prompt_of_prompt, prompt_of_row])
    row_of = torch.cat([torch.full_like(prompt_of_prompt, -1), rows])
    idx = torch.arange(len(prompt_of), device=rows.device)
    key_in_prompt_or_row = (row_of[None] == -1) | (row_of[None] == row_of[:, None])
    mask = ((prompt_of[:, None] == prompt_of[None]) & (idx[None] <= idx[:, None]) & key_in_prompt_or_row)[None, None]
    base = _base(model)
    if base.config._attn_implementation == "sdpa":
        return mask
    dtype = base.get_input_embeddings().weight.dtype
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def _base(model):
    inner = inner_model(model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner
