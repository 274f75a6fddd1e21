"""completions.jsonl rows for ``--log_completions``, with what the trajectory viewer (``grpokit view``) shows:
the group, the weighted reward, truncation, and for the first ``--log_completions_max_rows`` rows of a step the
per-token data (decoded piece, logprob and entropy under the rollout's weights, loss mask) of at most
``--log_completions_max_tokens`` completion tokens and small JPEG thumbnails of a vision row's images.

The per-token logprobs and entropies come from one extra no-grad forward of those rows (the same entry as the old
logps, ``_get_per_token_logps_and_entropies``), so a run without ``--log_completions`` pays nothing.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpokit.data.images import load_image, row_images
from grpokit.protocol import RolloutInferRequest, RolloutOutput
from grpokit.runs.outputs import CompletionLimits
from grpokit.trainers.batch import RolloutBatch
from grpokit.trainers.window import completion_rows

DIGITS = 4  # per-token floats are rounded: the file stays small and the colours do not need more


@dataclass
class TokenForward:
    """How the per-token values are computed: ``logps(model, batch, compute_entropy=True)`` on ``model``, in
    chunks of ``micro_batch_size`` rows on ``accelerator.device``."""

    logps: Callable
    model: object
    accelerator: object
    micro_batch_size: int


def completion_log_rows(
    requests: list[RolloutInferRequest],
    outputs: list[RolloutOutput],
    rewards_per_func: torch.Tensor,
    batch: RolloutBatch,
    rewards: torch.Tensor,
    reward_names: list[str],
    step: int,
    *,
    limits: CompletionLimits,
    forward: TokenForward,
    tokenizer,
    images: bool,
) -> list[dict]:
    """This process's rows of one step: ``batch`` holds the encoded rows (advantages set), ``rewards`` [N] the
    weighted sums of these rows."""
    adv, mask = batch.advantages, batch.completion_mask
    if adv.dim() == 2:  # a teacher's per-token advantages: their mean over the completion
        adv = (adv * mask).sum(1) / mask.sum(1).clamp(min=1)
    rows = completion_rows(requests, outputs, rewards_per_func, adv, reward_names, step)
    by_id = {r.request_id: r for r in requests}
    for i, (row, o) in enumerate(zip(rows, outputs, strict=True)):
        finish = o.response.choices[0].finish_reason if o.response.choices else None
        row.update(
            group=o.prompt_id,
            reward=float(rewards[i]),
            truncated=finish == "length",
            weight_version=o.oldest_weight_version(),
        )
    n = min(len(rows), limits.max_rows)
    if n and limits.max_tokens:
        logps, entropies = _token_values(batch.select(slice(0, n)), forward)
        width = batch.completion_mask.shape[1]
        ids = batch.input_ids[:n, -width:].tolist()
        real = batch.attention_mask[:n, -width:]
        for i in range(n):
            used = int(real[i].sum())  # completions are right-padded: their tokens come first
            keep = min(used, limits.max_tokens)
            tokens = {"text": token_pieces(tokenizer, ids[i][:keep]), "logprob": _rounded(logps[i, :keep])}
            if entropies is not None:  # an override of the logps entry may return none
                tokens["entropy"] = _rounded(entropies[i, :keep])
            tokens.update(mask=[int(m) for m in batch.completion_mask[i, :keep].tolist()], cut=used - keep)
            rows[i]["tokens"] = tokens
    if images:
        for row, o in zip(rows[:n], outputs[:n], strict=True):
            found = o.rollout_infos.get("images") or row_images(by_id[o.request_id].data_dict)
            if found:
                row["thumbnails"] = [thumbnail(img, limits.thumbnail_px) for img in found[: limits.max_images]]
    return rows


@torch.no_grad()
def _token_values(batch: RolloutBatch, forward: TokenForward) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[n, C] logps and entropies of ``batch``'s rows, chunk by chunk (each trimmed), on CPU; entropies None when
    the logps entry returned none."""
    logps = torch.zeros_like(batch.completion_mask)
    entropies: torch.Tensor | None = torch.zeros_like(batch.completion_mask)
    b, acc = forward.micro_batch_size, forward.accelerator
    for start in range(0, len(batch), b):
        chunk = batch.select(slice(start, start + b)).trim().to(acc.device)
        with acc.autocast():
            lp, ent = forward.logps(forward.model, chunk, compute_entropy=True)
        logps[start : start + b, : lp.shape[1]] = lp.float().cpu()
        if ent is None:
            entropies = None
        elif entropies is not None:
            entropies[start : start + b, : ent.shape[1]] = ent.float().cpu()
    return logps, entropies


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """Each token's text, so that the pieces join into the decoded completion. A token that is part of one
    character (a byte-level piece decodes to U+FFFD alone) is joined with the next ones, up to 4, and the
    character is shown on the first token of the run (the others get "")."""
    pieces = tokenizer.batch_decode([[t] for t in ids])
    i = 0
    while i < len(ids):
        if "\ufffd" in pieces[i]:
            for j in range(i + 1, min(i + 4, len(ids))):
                joined = tokenizer.decode(ids[i : j + 1])
                if "\ufffd" not in joined:
                    pieces[i : j + 1] = [joined] + [""] * (j - i)
                    i = j
                    break
        i += 1
    return pieces


def thumbnail(image, size: int) -> str:
    """A JPEG data URI of ``image`` (path, bytes, PIL image or ``{"bytes", "path"}``) at most ``size`` pixels a side."""
    img = load_image(image).copy()
    img.thumbnail((size, size))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=75)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _rounded(x: torch.Tensor) -> list[float]:
    return [round(v, DIGITS) for v in x.tolist()]
