"""The training forward's per-token logps: padded or packed rows (``--padding_free``), plain or chunked head.

``--logps_chunk_size N`` (default 1024) computes the logps in place of the model's output head, N rows of
logits at a time (engines/chunked_head.py, algorithms/chunked_logps.py); 0 keeps the plain path (full
[B, C, V] logits, then ``selective_log_softmax``). Models whose head the chunked path does not understand take
the plain path, logged once.

With the chunked head, rows that share a prompt (a group's completions) are packed into one row per group, each
distinct prompt once and no padding, where that costs less than the padded rows (trainers/packed_groups.py); the
values are the padded path's.

``--padding_free true`` (ms-swift's option): the micro-batch's rows, without their padding, become one row whose
``position_ids`` restart at 0 for each original row, with no attention mask. transformers 5 reads such
position_ids as packed sequences: its mask builders (``masking_utils``, which eager, sdpa and flex attention use)
make the mask block-diagonal, and flash attention runs varlen over the same boundaries. Only the positions that
predict completion tokens reach the head (``logits_to_keep`` as an index tensor). Prompt sharing does not apply
(there is no cache).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch

from grpokit.algorithms import SamplerSupport, entropy_from_logits, kept_set_log_softmax, selective_log_softmax
from grpokit.engines.chunked_head import ChunkedHead, hf_model, plain_reason
from grpokit.engines.prefix import completion_logits, shared_prompts, swapped_head
from grpokit.trainers.packed_groups import hidden_size, packable, packed_group_logits, worth_packing

log = logging.getLogger(__name__)

# attention implementations that honour packed position_ids without an attention mask (transformers 5.x)
PACKING_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
_MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask")
_logged: set[str] = set()


@dataclass(frozen=True)
class ForwardOptions:
    temperature: float  # the sampling temperature: logits are divided by it
    chunk_size: int  # rows of logits at a time; 0 = the plain path
    padding_free: bool
    share_prompts: bool  # compute each distinct prompt once (engines/prefix.py; padded rows only)


@dataclass
class Packed:
    input_ids: torch.Tensor  # [1, T] the real tokens of every row, one row after another
    position_ids: torch.Tensor  # [1, T] restarting at 0 for each row
    keep: torch.Tensor  # [K] packed positions that predict a completion token
    rows: torch.Tensor  # [K] its row in the padded batch
    cols: torch.Tensor  # [K] its completion column


def pack_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: int
) -> Packed:
    """The padded rows [B, P+C] (prompts left-padded, completions right-padded) as one packed row."""
    real = attention_mask.bool()
    packed_index = real.flatten().cumsum(0).view_as(real) - 1  # [B, P+C] position of each real token
    p = input_ids.shape[1] - logits_to_keep
    rows, cols = real[:, p:].nonzero(as_tuple=True)
    before = p + cols - 1  # the position predicting completion token (row, col)
    if not ((before >= 0) & real[rows, before.clamp(min=0)]).all():
        raise ValueError("padding_free: a completion token has no prompt token before it; every row needs a prompt")
    return Packed(input_ids[real].unsqueeze(0), position_ids[real].unsqueeze(0), packed_index[rows, before], rows, cols)


def check_packing(model, model_inputs: dict) -> None:
    """Refuse --padding_free where packed rows would attend to each other or extra inputs cannot be packed."""
    extra = sorted(set(model_inputs) - {"input_ids", "attention_mask", "position_ids"})
    if extra:
        raise ValueError(
            f"--padding_free true packs input_ids, attention_mask and position_ids only; the model "
            f"inputs also have {extra}: use --padding_free false"
        )
    base = hf_model(model)
    impl = getattr(base.config, "_attn_implementation", None)
    if impl not in PACKING_ATTENTION:
        raise ValueError(
            f"--padding_free true: attention implementation {impl!r} does not separate packed rows; "
            f"load the model with one of {', '.join(PACKING_ATTENTION)}, or use --padding_free false"
        )
    if not impl.startswith("flash") and impl not in _logged:
        _logged.add(impl)
        log.warning(
            "--padding_free true with %s attention: correct, but the packed row's attention spans every "
            "token of the micro-batch (cost ~ T²); flash attention computes each row alone",
            impl,
        )
    modeling = sys.modules.get(type(base).__module__)
    if not any(hasattr(modeling, name) for name in _MASK_BUILDERS) and not impl.startswith("flash"):
        raise ValueError(
            f"--padding_free true: {type(base).__name__} builds its own attention mask, which would "
            "let packed rows attend to each other; use --padding_free false"
        )


def completion_logps(
    model,
    model_inputs: dict,
    logits_to_keep: int,
    opts: ForwardOptions,
    compute_entropy: bool = False,
    support: SamplerSupport | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, C] logps of the last C = ``logits_to_keep`` tokens (float32), and their entropies when asked; with
    ``support``, over the sampler's kept set (algorithms/kept_set.py)."""
    head = None
    if opts.chunk_size > 0:
        reason = plain_reason(model)
        if reason is None:
            head = ChunkedHead(model, opts.temperature, opts.chunk_size, compute_entropy, support)
        elif reason not in _logged:
            _logged.add(reason)
            log.info("logps take the plain path (full logits) for this model: %s", reason)
    ids = model_inputs["input_ids"]
    if not opts.padding_free:
        out = _packed_groups(model, model_inputs, logits_to_keep, head)
        if out is not None:
            return _split(out, ids[:, -logits_to_keep:], head, opts.temperature, compute_entropy, support)
        out = completion_logits(
            model, logits_to_keep=logits_to_keep, share_prompts=opts.share_prompts, head=head, **model_inputs
        )
        return _split(out, ids[:, -logits_to_keep:], head, opts.temperature, compute_entropy, support)
    check_packing(model, model_inputs)
    packed = pack_rows(ids, model_inputs["attention_mask"], model_inputs["position_ids"], logits_to_keep)
    targets = packed.input_ids[:, packed.keep + 1]  # [1, K]
    with swapped_head(head, targets) as take:
        out = model(
            input_ids=packed.input_ids,
            attention_mask=None,
            position_ids=packed.position_ids,
            logits_to_keep=packed.keep,
            use_cache=False,
        )
    logps_k, ent_k = _split(take(out), targets, head, opts.temperature, compute_entropy, support)
    return _unpack(logps_k[0], packed, ids.shape[0], logits_to_keep), (
        _unpack(ent_k[0], packed, ids.shape[0], logits_to_keep) if ent_k is not None else None
    )


def _packed_groups(model, model_inputs: dict, logits_to_keep: int, head) -> torch.Tensor | None:
    """The chunked head's results with each group packed into one row (trainers/packed_groups.py), or None where
    that does not apply or would not pay (the padded path then runs). One forward per call, so it runs under
    DDP/FSDP/DeepSpeed wrappers and gradient checkpointing too, unlike the cached prompt sharing."""
    if head is None or not packable(model, model_inputs, logits_to_keep):
        return None
    plan = shared_prompts(model_inputs["input_ids"], logits_to_keep)
    if plan is None or not worth_packing(model_inputs["attention_mask"], logits_to_keep, plan, hidden_size(model)):
        return None
    return packed_group_logits(model, model_inputs, logits_to_keep, head, plan)


def _split(
    out: torch.Tensor,
    targets: torch.Tensor,
    head,
    temperature: float,
    compute_entropy: bool,
    support: SamplerSupport | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logps, entropies) from the chunked head's [.., n, k] results or from plain logits [.., n, V]."""
    if head is not None:
        return out[..., 0], (out[..., 1] if compute_entropy else None)
    logits = out.to(torch.float64 if out.dtype == torch.float64 else torch.float32) / temperature
    logps = (
        selective_log_softmax(logits, targets) if support is None else kept_set_log_softmax(logits, targets, support)
    )
    if not compute_entropy:
        return logps, None
    with torch.no_grad():
        return logps, entropy_from_logits(logits)


def _unpack(values: torch.Tensor, packed: Packed, batch: int, width: int) -> torch.Tensor:
    """[K] → [B, C], zeros at padded completion positions (which the completion mask leaves out)."""
    out = values.new_zeros(batch, width)
    return out.index_put((packed.rows, packed.cols), values)
