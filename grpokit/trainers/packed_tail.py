"""The training forward with each distinct prompt run once and the completions packed: no padding computed.

Prompt sharing (engines/prefix.py) runs a group's prompt once, then every completion row against its prompt's
cached keys and values; but the rows are right-padded to the longest completion, and the padding runs through the
model and the head like real tokens. When completions end at very different lengths (a typical GRPO batch), most
of that tail is padding. Here the completion tokens of every row, without their padding, become one row; each
attends to its own prompt's cache entries and to the tokens before it in its own completion, through a 4D mask
given to the model (transformers uses a 4D mask as it is). The logps are the padded path's, up to floating-point
summation order, for every real token; padded positions get 0 (the completion mask leaves them out).

It applies where such a mask means the same thing: sdpa or eager attention, no sliding window, no model inputs
besides the token ids, the mask and the positions, the chunked head, a cache whose layers hold plain key and value
tensors, and completions whose real tokens come first in each row. Elsewhere the padded path runs.
"""

from __future__ import annotations

import torch

from grpokit.engines.chunked_head import inner_model
from grpokit.engines.prefix import _output_cache, cache_kwarg, swapped_head

MASK_ATTENTION = ("sdpa", "eager")  # attention implementations that read a 4D mask as given


def packable(model, model_inputs: dict, logits_to_keep: int) -> bool:
    """Whether the packed tail computes what the padded prompt-sharing path computes for this batch."""
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
    real = model_inputs["attention_mask"][:, -logits_to_keep:].bool()
    return not bool((real[:, 1:] & ~real[:, :-1]).any())  # every row: its real tokens, then padding


def packed_tail_logits(model, model_inputs: dict, logits_to_keep: int, head, plan) -> torch.Tensor | None:
    """The chunked head's per-token results [B, C, k] for the last C = ``logits_to_keep`` tokens, 0 at padded
    positions; ``plan``: (first row of each distinct prompt, row → prompt) from engines/prefix.shared_prompts.
    None where the model's cache is not made of plain key/value layers (the caller takes the padded path)."""
    input_ids, attention_mask, position_ids = (model_inputs[k] for k in ("input_ids", "attention_mask", "position_ids"))
    first, inverse = plan
    c = logits_to_keep
    p = input_ids.shape[1] - c
    with swapped_head(head, input_ids[:, p : p + 1], rows=inverse) as take:  # per row: its prompt's last position
        prompt_out = model(
            input_ids=input_ids[first, :p],
            attention_mask=attention_mask[first, :p],
            position_ids=position_ids[first, :p],
            use_cache=True,
            logits_to_keep=1,
        )
    first_out = take(prompt_out)  # [B, 1, k]
    cache = _output_cache(prompt_out)
    if not _flatten_prompts(cache):
        return None
    real = attention_mask[:, p:].bool()
    rows, cols = real.nonzero(as_tuple=True)  # row by row, columns ascending
    rest = first_out.new_zeros(input_ids.shape[0], c - 1, first_out.shape[-1])  # columns 1..C-1
    keep = ((rows[1:] == rows[:-1]) & (cols[1:] == cols[:-1] + 1)).nonzero()[:, 0]  # positions with a next token
    if len(keep):
        ids = input_ids[:, p:][rows, cols][None]
        mask = _tail_mask(attention_mask[first, :p].bool(), inverse[rows], rows, model)
        with swapped_head(head, ids[:, keep + 1]) as take:
            tail = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=position_ids[:, p:][rows, cols][None],
                use_cache=True,
                logits_to_keep=keep,
                **{cache_kwarg(model): cache},
            )
        rest = rest.index_put((rows[keep], cols[keep]), take(tail)[0])  # (row, col) predicts column col + 1
    return torch.cat([first_out, rest], dim=1)


def _flatten_prompts(cache) -> bool:
    """The prompts' cache [U, kv, P, d] per layer as one row [1, kv, U·P, d] (prompt u's position j at u·P + j),
    in place; False where its layers are not plain key/value tensors."""
    layers = getattr(cache, "layers", None)
    if not layers or any(not torch.is_tensor(getattr(x, "keys", None)) or x.keys.dim() != 4 for x in layers):
        return False
    if any(getattr(x, "is_sliding", False) for x in layers):
        return False
    for layer in layers:
        u, kv, p, d = layer.keys.shape
        layer.keys = layer.keys.transpose(0, 1).reshape(1, kv, u * p, d)
        layer.values = layer.values.transpose(0, 1).reshape(1, kv, u * p, d)
    return True


def _tail_mask(prompt_valid: torch.Tensor, prompt_of: torch.Tensor, rows: torch.Tensor, model) -> torch.Tensor:
    """[1, 1, T, U·P + T]: packed token t sees its own prompt's real positions and its row's tokens up to itself
    (boolean for sdpa, additive for eager)."""
    u = prompt_valid.shape[0]
    own = prompt_of[:, None] == torch.arange(u, device=rows.device)[None]  # [T, U]
    sees_prompt = (own[:, :, None] & prompt_valid[None]).flatten(1)  # [T, U·P]
    t = torch.arange(len(rows), device=rows.device)
    sees_tail = (rows[:, None] == rows[None]) & (t[None] <= t[:, None])  # [T, T]
    mask = torch.cat([sees_prompt, sees_tail], dim=1)[None, None]
    base = _base(model)
    if base.config._attn_implementation == "sdpa":
        return mask
    dtype = base.get_input_embeddings().weight.dtype
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def _base(model):
    inner = inner_model(model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner
