"""The window's batch: rollouts encoded into padded tensors, and its micro-batch slices."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from grpokit.errors import RolloutError
from grpokit.template.encode import EncodedSample
from grpokit.template.processor import MMRow


@dataclass
class RolloutBatch:
    """Tensors for one window (this process's share). Prompts are left-padded, completions right-padded."""

    input_ids: torch.Tensor  # [N, P+C]
    attention_mask: torch.Tensor  # [N, P+C]
    position_ids: torch.Tensor  # [N, P+C]
    completion_mask: torch.Tensor  # [N, C] float, 1 = trained token
    truncated: torch.Tensor  # [N] bool, completion hit the length limit
    advantages: torch.Tensor | None = None  # [N]
    old_logps: torch.Tensor | None = None  # [N, C]
    ref_logps: torch.Tensor | None = None  # [N, C]
    rollout_logps: torch.Tensor | None = None  # [N, C] engine logprobs (NaN where missing)
    num_items: float | None = None  # loss denominator for dapo/cispo (set per micro-batch)
    extra: dict[str, Any] = field(default_factory=dict)  # per-row tensors a _prepare_inputs override adds
    mm_inputs: list[MMRow] | None = None  # vision-language models: each row's processor tensors (collate_mm)

    @property
    def logits_to_keep(self) -> int:
        return self.completion_mask.shape[1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor | slice) -> RolloutBatch:
        """Rows ``idx`` of every per-sample tensor."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v[idx] if isinstance(v, torch.Tensor) else v
        out["extra"] = {k: (v[idx] if isinstance(v, torch.Tensor) else v) for k, v in self.extra.items()}
        if self.mm_inputs is not None:  # whole rows: a row's images never part from its image tokens
            rows = range(len(self))[idx] if isinstance(idx, slice) else (
                idx.nonzero().flatten() if idx.dtype == torch.bool else idx).tolist()
            out["mm_inputs"] = [self.mm_inputs[i] for i in rows]
        return RolloutBatch(**out)

    def split(self, n: int) -> list[RolloutBatch]:
        """``n`` equal micro-batches, each trimmed to its own longest prompt and completion."""
        if n == 1:
            return [self.trim()]
        size = len(self) // n
        return [self.select(slice(i * size, (i + 1) * size)).trim() for i in range(n)]

    def trim(self) -> RolloutBatch:
        """Drop padding columns that no row of this batch uses (left of prompts, right of completions)."""
        c = self.logits_to_keep
        p = self.input_ids.shape[1] - c
        used_p = self.attention_mask[:, :p].any(0).nonzero()
        first = int(used_p[0]) if len(used_p) else p
        used_c = self.attention_mask[:, p:].any(0).nonzero()
        keep_c = max(1, int(used_c[-1]) + 1 if len(used_c) else 1)
        cols = slice(first, p + keep_c)
        out = replace(self, input_ids=self.input_ids[:, cols], attention_mask=self.attention_mask[:, cols],
                      position_ids=self.position_ids[:, cols], completion_mask=self.completion_mask[:, :keep_c])
        for name in ("old_logps", "ref_logps", "rollout_logps"):
            v = getattr(out, name)
            if v is not None:
                setattr(out, name, v[:, :keep_c])
        return out

    def to(self, device) -> RolloutBatch:
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)


def collate(samples: list[EncodedSample], pad_id: int, truncated: list[bool],
            max_completion_length: int | None = None) -> RolloutBatch:
    """Pad prompts on the left and completions on the right; positions count real tokens only."""
    if max_completion_length is not None:
        for s in samples:  # a multi-turn trajectory may exceed the total budget: cut it (the tail trains nothing)
            if len(s.completion_ids) > max_completion_length:
                if s.extra.get("images_end", 0) > max_completion_length:
                    raise RolloutError(f"a trajectory of {len(s.completion_ids)} completion tokens has observation "
                                       f"image tokens beyond --max_completion_length {max_completion_length}; "
                                       "raise it, or end trajectories before their observations outgrow it")
                s.completion_ids = s.completion_ids[:max_completion_length]
                s.completion_mask = s.completion_mask[:max_completion_length]
                if s.rollout_logprobs is not None:
                    s.rollout_logprobs = s.rollout_logprobs[:max_completion_length]
    p_len = max(len(s.prompt_ids) for s in samples)
    c_len = max(1, max(len(s.completion_ids) for s in samples))
    have_lps = any(s.rollout_logprobs is not None for s in samples)
    ids: list[int] = []  # padded rows, flat: one tensor call per field
    att: list[int] = []
    cmask: list[float] = []
    lps: list[float] = []
    for s in samples:
        p, c = len(s.prompt_ids), len(s.completion_ids)
        left, right = p_len - p, c_len - c
        ids += [pad_id] * left + s.prompt_ids + s.completion_ids + [pad_id] * right
        att += [0] * left + [1] * (p + c) + [0] * right
        cmask += s.completion_mask + [0] * right
        if have_lps:
            lps += (s.rollout_logprobs if s.rollout_logprobs is not None else [float("nan")] * c) \
                + [float("nan")] * right
    n, width = len(samples), p_len + c_len
    input_ids = torch.tensor(ids, dtype=torch.long).view(n, width)
    attention = torch.tensor(att, dtype=torch.long).view(n, width)
    rollout = torch.tensor(lps, dtype=torch.float32).view(n, c_len) if have_lps else None
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    mm = [s.extra.get("mm", MMRow()) for s in samples] if any("mm" in s.extra for s in samples) else None
    return RolloutBatch(input_ids, attention, position_ids, torch.tensor(cmask, dtype=torch.float32).view(n, c_len),
                        torch.tensor(truncated, dtype=torch.bool), rollout_logps=rollout, mm_inputs=mm)
