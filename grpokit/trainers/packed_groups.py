"""The training forward with each distinct prompt run once and no padding computed: a packed row per group.

Prompt sharing (engines/prefix.py) runs a group's prompt once, then every completion row against its prompt's
cached keys and values; but the rows are right-padded to the longest completion, and that padding runs through
the model and the head like real tokens. When completions end at very different lengths (a typical GRPO batch),
much of the tail is padding. Here each group is one row: its prompt's real tokens, then its completions' real
tokens one after another, and a 4D mask (transformers uses a 4D mask as given) lets a prompt token see its prompt
up to itself and a completion token its whole prompt and its own completion up to itself. One forward, so each
weight is read once and gets one gradient (the cached path's prompt and tail forwards each make one, summed by
autograd). The logps and gradients are the padded path's up to floating-point summation order; padded positions
get 0 (the completion mask leaves them out).

It applies where such a mask means the same thing: sdpa or eager attention, no sliding window, no model inputs
besides the token ids, the mask and the positions, the chunked head, every row with a prompt token and its
completion's real tokens first; and where it costs less than the padded path (``worth_packing``).
"""

from __future__ import annotations

import torch

from grpokit.engines.chunked_head import hf_model
from grpokit.engines.prefix import swapped_head

MASK_ATTENTION = ("sdpa", "eager")  # attention implementations that read a 4D mask as given


def packable(model, model_inputs: dict, logits_to_keep: int) -> bool:
    """Whether the packed row computes what the padded prompt-sharing path computes for this batch."""
    if set(model_inputs) - {"input_ids", "attention_mask", "position_ids"} or model_inputs["position_ids"] is None:
        return False
    config = getattr(hf_model(model), "config", None)  # None: a wrapper of the caller's own, not a transformers model
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


def _group_lengths(attention_mask: torch.Tensor, logits_to_keep: int, plan) -> torch.Tensor:
    """Real tokens per group [U]: its prompt's and all its completions'."""
    first, inverse = plan
    p = attention_mask.shape[1] - logits_to_keep
    completions = attention_mask[:, p:].sum(1)
    return attention_mask[first, :p].sum(1) + completions.new_zeros(len(first)).index_add(0, inverse, completions)


def worth_packing(attention_mask: torch.Tensor, logits_to_keep: int, plan, hidden: int) -> bool:
    """Whether packing pays for this batch. Per layer a token costs about 12·H² multiply-adds in its linear layers
    and an attention pair (query, key) 4·H, so a forward costs about 3·H·tokens + pairs in units of 4·H. Packed,
    U rows of L tokens (the longest group's real tokens) and U·L² pairs; padded, U·P + B·C tokens and
    U·P² + B·C·(P + C) pairs (U prompts of width P, B rows of width C). Packing runs where it costs less, and
    never with more than 4 times the padded path's attention pairs (the scores' memory)."""
    b, width = attention_mask.shape
    c, p, u = logits_to_keep, width - logits_to_keep, len(plan[0])
    length = int(_group_lengths(attention_mask, logits_to_keep, plan).max())
    tokens, pairs = u * length, u * length * length
    padded_tokens, padded_pairs = u * p + b * c, u * p * p + b * c * (p + c)
    return 3 * hidden * tokens + pairs < 3 * hidden * padded_tokens + padded_pairs and pairs <= 4 * padded_pairs


def packed_group_logits(model, model_inputs: dict, logits_to_keep: int, head, plan) -> torch.Tensor:
    """The chunked head's per-token results [B, C, k] for the last C = ``logits_to_keep`` tokens, 0 at padded
    positions; ``plan``: (first row of each distinct prompt, row → prompt) from engines/prefix.shared_prompts.

    A row per group: its prompt's real tokens, then each of its completions' real tokens (padded to the longest
    group). A prompt token sees its prompt up to itself; a completion token sees its whole prompt and its own
    completion up to itself. The head runs at each prompt's last token (for the first completion token of each of
    its rows) and at every completion token that has a next one."""
    input_ids, attention_mask, position_ids = (model_inputs[k] for k in ("input_ids", "attention_mask", "position_ids"))
    first, inverse = plan
    b, width = input_ids.shape
    p = width - logits_to_keep
    pu, pj = attention_mask[first, :p].bool().nonzero(as_tuple=True)  # prompt by prompt, positions ascending
    rows, cols = attention_mask[:, p:].bool().nonzero(as_tuple=True)  # row by row, columns ascending
    n = len(pu)
    group = torch.cat([pu, inverse[rows]])  # every real token's group: prompts' first, then completions'
    row_of = torch.cat([torch.full_like(pu, -1), rows])  # -1: a prompt token
    tokens = torch.cat([input_ids[first, :p][pu, pj], input_ids[:, p:][rows, cols]])
    positions = torch.cat([position_ids[first, :p][pu, pj], position_ids[:, p:][rows, cols]])
    counts = torch.bincount(group, minlength=len(first))
    order = torch.sort(group, stable=True).indices  # a group's prompt tokens, then its rows' tokens, in order
    slot = torch.empty_like(order)
    slot[order] = torch.arange(len(group), device=group.device) - (counts.cumsum(0) - counts)[group[order]]
    grid = (len(first), int(counts.max()))
    where = (group, slot)
    ids = input_ids.new_zeros(grid).index_put(where, tokens)
    pos = position_ids.new_zeros(grid).index_put(where, positions)
    row_grid = row_of.new_full(grid, -2).index_put(where, row_of)  # -2: padding
    nxt = ((rows[1:] == rows[:-1]) & (cols[1:] == cols[:-1] + 1)).nonzero()[:, 0]  # completion tokens with a next
    last = torch.bincount(pu, minlength=len(first)) - 1  # each prompt's last token, in its group's row
    at = (torch.cat([inverse, group[n + nxt]]), torch.cat([last[inverse], slot[n + nxt]]))
    targets = torch.cat([input_ids[:, p], tokens[n + nxt + 1]])
    with swapped_head(head, targets, rows=at) as take:
        got = model(input_ids=ids, attention_mask=_group_mask(row_grid, model), position_ids=pos, use_cache=False)
    results = take(got)
    out = results.new_zeros(b, logits_to_keep, results.shape[-1])
    zero = torch.zeros_like(inverse)
    return out.index_put(
        (torch.cat([torch.arange(b, device=zero.device), rows[nxt]]), torch.cat([zero, cols[nxt] + 1])), results
    )


def _group_mask(row_grid: torch.Tensor, model) -> torch.Tensor:
    """[U, 1, L, L] (boolean for sdpa, additive for eager): a key no later than its query, and a prompt token or
    one of the query's own row; a padding query sees itself only (finite, never read)."""
    length = row_grid.shape[1]
    idx = torch.arange(length, device=row_grid.device)
    keys, queries = row_grid[:, None, :], row_grid[:, :, None]
    mask = (idx[None, None] <= idx[None, :, None]) & (keys != -2) & ((keys == -1) | (keys == queries))
    mask = (mask | torch.eye(length, dtype=torch.bool, device=mask.device))[:, None]
    base = hf_model(model)
    if base.config._attn_implementation == "sdpa":
        return mask
    dtype = base.get_input_embeddings().weight.dtype
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def hidden_size(model) -> int:
    """The model's hidden size, from its config (a ZeRO-3 partitioned weight has no shape to read it from)."""
    config = hf_model(model).config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.hidden_size)
