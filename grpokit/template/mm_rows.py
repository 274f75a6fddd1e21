"""One vision-language prompt's processor outputs (``MMRow``) and how rows join and collate into model inputs.

A row carries, besides its ids, the processor's tensors for that one prompt (and per-token tensors over the
completion of a multi-turn trajectory). A batch is always a list of whole rows: ``collate_mm`` pads and stacks them,
so splitting a batch can never separate an image from its tokens (``grpokit.template.processor`` makes the rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# per-token tensors: left-padded like the prompt, zeros over the completion
TOKEN_KEYS = ("mm_token_type_ids", "token_type_ids")


@dataclass
class MMRow:
    """One prompt's processor outputs besides its ids: name → tensor with the processor's batch layout for one
    row (``[1, L]`` per-token tensors; ``pixel_values`` as the processor stacks one row's images)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # per-token tensors over the completion ([1, C]; a trajectory whose observations hold images), else zeros
    completion: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def has_images(self) -> bool:
        return "pixel_values" in self.tensors

    def split(self, prompt_len: int) -> MMRow:
        """This row (covering prompt and completion tokens) with its per-token tensors cut at ``prompt_len``."""
        tensors = {k: (v.reshape(1, -1)[:, :prompt_len] if k in TOKEN_KEYS else v) for k, v in self.tensors.items()}
        completion = {k: v.reshape(1, -1)[:, prompt_len:] for k, v in self.tensors.items() if k in TOKEN_KEYS}
        return MMRow(tensors, completion)


def join_rows(a: MMRow, a_len: int, b: MMRow, b_len: int) -> MMRow:
    """The row of ``a_len`` tokens (``a``) followed by ``b_len`` tokens (``b``): per-token tensors end to end
    (zeros where a side has none), images in sequence order (Idefics3's per-row image axis is dim 1)."""
    out: dict[str, torch.Tensor] = {}
    slots = _row_slots([a, b])
    for key in {**a.tensors, **b.tensors}:
        x, y = a.tensors.get(key), b.tensors.get(key)
        if key in TOKEN_KEYS:
            like = x if x is not None else y
            x = like.new_zeros((1, a_len)) if x is None else x.reshape(1, -1)
            y = like.new_zeros((1, b_len)) if y is None else y.reshape(1, -1)
            out[key] = torch.cat([x, y], dim=1)
        elif x is None or y is None:
            out[key] = x if y is None else y
        else:
            out[key] = torch.cat([x, y], dim=1 if slots and key in ("pixel_values", "pixel_attention_mask") else 0)
    return MMRow(out)


def collate_mm(rows: list[MMRow], prompt_width: int, completion_width: int = 0) -> dict[str, torch.Tensor]:
    """Model inputs of a batch of rows whose prompts are left-padded to ``prompt_width`` and followed by
    ``completion_width`` completion columns. Per-token tensors are padded with zeros; ``pixel_values`` are
    concatenated image by image (Qwen-VL's patches, Gemma3's images) or, where the processor gives each row its
    own slot ([1, N, C, H, W], Idefics3), padded to the row with the most images (all-zero images are padding
    to the model) together with ``pixel_attention_mask``; ``image_grid_thw`` is concatenated."""
    keys = {k for r in rows for k in (*r.tensors, *r.completion)}
    out: dict[str, torch.Tensor] = {}
    for key in sorted(keys):
        present = [r.tensors[key] for r in rows if key in r.tensors]
        if key in TOKEN_KEYS:
            cols = []
            for r in rows:
                t, c = (
                    torch.zeros(0, dtype=torch.long) if x is None else x.reshape(-1)
                    for x in (r.tensors.get(key), r.completion.get(key))
                )
                c = c[:completion_width].to(t.dtype)
                cols.append(
                    torch.cat([t.new_zeros(prompt_width - len(t)), t, c, t.new_zeros(completion_width - len(c))])
                )
            out[key] = torch.stack(cols)
        elif present[0].dim() in (4, 5) and key in ("pixel_values", "pixel_attention_mask") and _row_slots(rows):
            most = max(r.tensors[key].shape[1] if key in r.tensors else 0 for r in rows)
            like = present[0][0, :1]
            out[key] = torch.stack([_pad_images(r.tensors.get(key), most, like) for r in rows])
        else:
            out[key] = torch.cat(present)
    if "pixel_values" not in out:  # no image in this batch: the model runs its text-only path
        out = {k: v for k, v in out.items() if k in TOKEN_KEYS}
    return out


def _row_slots(rows: list[MMRow]) -> bool:
    """The processor keeps a per-row image axis (Idefics3: pixel_values [1, N, C, H, W])."""
    pv = next((r.tensors["pixel_values"] for r in rows if r.has_images), None)
    return pv is not None and pv.dim() == 5


def _pad_images(t: torch.Tensor | None, most: int, like: torch.Tensor) -> torch.Tensor:
    have = 0 if t is None else t.shape[1]
    pad = like.new_zeros((most - have, *like.shape[1:]))
    return pad if t is None else torch.cat([t[0], pad])
