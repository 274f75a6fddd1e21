"""The window's batch: rollouts encoded into padded tensors, and its micro-batch slices.

A ``RolloutBatch`` is typed first (``batch.completion_mask``) and also reads as the seed's mini-batch dict
(``batch['completion_mask']``, ``batch['old_per_token_logps']``, ``.get``, ``in``, assignment), so that code
written for ms-swift's ``_compute_loss_and_metrics`` runs on it. Keys that are no field of the batch live in
``extra`` and travel with every ``select``/``split``/``to``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from grpokit.algorithms.kept_set import SamplerSupport
from grpokit.errors import PluginError, RolloutError
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
    advantages: torch.Tensor | None = None  # [N], or [N, C] per token with a teacher (algorithms/distill.py)
    old_logps: torch.Tensor | None = None  # [N, C]
    ref_logps: torch.Tensor | None = None  # [N, C]
    rollout_logps: torch.Tensor | None = None  # [N, C] engine logprobs (NaN where missing)
    weight_version: torch.Tensor | None = None  # [N] long: the oldest weight version that sampled the row
    num_items: float | None = None  # loss denominator for dapo/cispo (set per micro-batch)
    extra: dict[str, Any] = field(default_factory=dict)  # per-row tensors a _prepare_inputs override adds
    mm_inputs: list[MMRow] | None = None  # vision-language models: each row's processor tensors (collate_mm)
    # the sampler's kept set, as SamplerSupport's fields in plain values (a checkpoint loads with weights_only);
    # None: logps over the full vocabulary (nothing truncated, or --logps_support full)
    sampler_support: dict[str, Any] | None = None
    # what one training step's loss reported, filled by training_step and read by the loop (not batch data)
    step_metrics: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def logits_to_keep(self) -> int:
        return self.completion_mask.shape[1]

    @property
    def support(self) -> SamplerSupport | None:
        """The kept set the training logps are renormalised over (algorithms/kept_set.py), or None."""
        s = self.sampler_support
        return None if s is None else SamplerSupport(**{**s, "blocked": tuple(s.get("blocked", ()))})

    # -- the seed's names: ms-swift's mini-batch dict keys, as attributes and as keys ----------------------------
    @property
    def truncated_mask(self) -> torch.Tensor:
        return self.truncated

    @property
    def old_per_token_logps(self) -> torch.Tensor | None:
        return self.old_logps

    @property
    def ref_per_token_logps(self) -> torch.Tensor | None:
        return self.ref_logps

    @property
    def rollout_per_token_logps(self) -> torch.Tensor | None:
        return self.rollout_logps

    @property
    def num_items_in_batch(self) -> float | None:
        return self.num_items

    def __getitem__(self, key: str) -> Any:
        name = SEED_KEYS.get(key)
        if name is not None:
            return getattr(self, name)
        if key in self.extra:
            return self.extra[key]
        raise KeyError(
            f"{key!r}: the batch has the seed's keys {', '.join(SEED_KEYS)} and the extra keys "
            f"{', '.join(self.extra) or '(none)'}; add one with batch[{key!r}] = tensor"
        )

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "logits_to_keep":
            raise KeyError(
                "batch['logits_to_keep'] is the completion width (completion_mask.shape[1]); change it "
                "by cutting completion_mask and the [N, C] logps, not by assignment"
            )
        name = SEED_KEYS.get(key)
        if name is not None:
            setattr(self, name, value)
        else:
            self.extra[key] = value

    def __contains__(self, key: object) -> bool:
        name = SEED_KEYS.get(key) if isinstance(key, str) else None
        return getattr(self, name) is not None if name is not None else key in self.extra

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __iter__(self) -> Iterator[str]:
        return self.keys()

    def keys(self) -> Iterator[str]:
        """The keys that hold a value: the seed's that are set, then the extra ones."""
        yield from (k for k in SEED_KEYS if k in self)
        yield from self.extra

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor | slice) -> RolloutBatch:
        """Rows ``idx`` of every per-sample tensor."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v[idx] if isinstance(v, torch.Tensor) else v
        out["step_metrics"] = {}
        n = len(self)
        out["extra"] = {
            k: (
                v[idx]
                if isinstance(v, torch.Tensor) or (isinstance(v, list) and isinstance(idx, slice) and len(v) == n)
                else v
            )
            for k, v in self.extra.items()
        }
        if self.mm_inputs is not None:  # whole rows: a row's images never part from its image tokens
            rows = (
                range(len(self))[idx]
                if isinstance(idx, slice)
                else (idx.nonzero().flatten() if idx.dtype == torch.bool else idx).tolist()
            )
            out["mm_inputs"] = [self.mm_inputs[i] for i in rows]
        return RolloutBatch(**out)

    def split(self, n: int) -> list[RolloutBatch]:
        """``n`` equal micro-batches, each trimmed to its own longest prompt and completion."""
        if n == 1:
            return [self.trim()]
        size = len(self) // n
        return [self.select(slice(i * size, (i + 1) * size)).trim() for i in range(n)]

    def chunks(self, n: int) -> list[RolloutBatch]:
        """``n`` equal consecutive row slices at the window's width (the seed's mini-batch dicts, untrimmed)."""
        size = len(self) // n
        return [self.select(slice(i * size, (i + 1) * size)) for i in range(n)]

    @staticmethod
    def join(parts: list[RolloutBatch], rows: int, hook: str) -> RolloutBatch:
        """The mini-batches of a window put back together in order (their rows, and every key one of them has),
        checked: ``hook`` names the override that returned them, ``rows`` is how many the window has."""
        if not isinstance(parts, list) or not parts or not all(isinstance(p, RolloutBatch) for p in parts):
            raise PluginError(
                f"{hook} returned {type(parts).__name__}; return the list of mini-batches that "
                "super() returned (each may have keys added)"
            )
        if sum(len(p) for p in parts) != rows:
            raise PluginError(
                f"{hook} returned mini-batches of {sum(len(p) for p in parts)} rows in all; the window "
                f"has {rows} (add keys to the mini-batches, keep their rows)"
            )
        widths = {(p.input_ids.shape[1], p.logits_to_keep) for p in parts}
        if len(widths) > 1:
            raise PluginError(
                f"{hook} returned mini-batches of different widths {sorted(widths)}; keep the "
                "window's padding (the loop trims each micro-batch itself)"
            )
        keys = [set(p.extra) for p in parts]
        if any(k != keys[0] for k in keys):
            raise PluginError(f"{hook}: every mini-batch needs the same added keys, got {[sorted(k) for k in keys]}")
        out: dict[str, Any] = {}
        for f in fields(RolloutBatch):
            if f.name in ("extra", "mm_inputs", "step_metrics"):
                continue
            values = [getattr(p, f.name) for p in parts]
            out[f.name] = torch.cat(values) if isinstance(values[0], torch.Tensor) else values[0]
        out["extra"] = {k: _cat([p.extra[k] for p in parts], k, hook) for k in keys[0]}
        mm = [p.mm_inputs for p in parts]
        out["mm_inputs"] = None if mm[0] is None else [row for m in mm for row in m]
        return RolloutBatch(**out)

    def trim(self) -> RolloutBatch:
        """Drop padding columns that no row of this batch uses (left of prompts, right of completions)."""
        c = self.logits_to_keep
        p = self.input_ids.shape[1] - c
        used_p = self.attention_mask[:, :p].any(0).nonzero()
        first = int(used_p[0]) if len(used_p) else p
        used_c = self.attention_mask[:, p:].any(0).nonzero()
        keep_c = max(1, int(used_c[-1]) + 1 if len(used_c) else 1)
        cols = slice(first, p + keep_c)
        out = replace(
            self,
            input_ids=self.input_ids[:, cols],
            attention_mask=self.attention_mask[:, cols],
            position_ids=self.position_ids[:, cols],
            completion_mask=self.completion_mask[:, :keep_c],
        )
        for name in ("old_logps", "ref_logps", "rollout_logps", "advantages"):
            v = getattr(out, name)
            if v is not None and v.dim() == 2:  # advantages are [N] or, with a teacher, per token [N, C]
                setattr(out, name, v[:, :keep_c])
        return out

    def to(self, device) -> RolloutBatch:
        """The batch with its tensors on ``device``, the extra ones too (the step's metrics dict is shared: what
        the loss reports on the moved batch reaches the loop)."""
        moved: dict[str, Any] = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        moved["extra"] = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.extra.items()}
        out = replace(self, **moved)
        out.step_metrics = self.step_metrics
        return out


def _cat(values: list, key: str, hook: str) -> Any:
    """One added key over the window's mini-batches: tensors (one row each) concatenated, lists joined."""
    if all(isinstance(v, torch.Tensor) and v.ndim > 0 for v in values):
        return torch.cat(values)
    if all(isinstance(v, list) for v in values):
        return [x for v in values for x in v]
    raise PluginError(
        f"{hook}: key {key!r} must be a tensor or a list with one entry per row in each mini-batch, "
        f"got {', '.join(type(v).__name__ for v in values)}"
    )


# ms-swift's mini-batch dict keys → RolloutBatch fields (logits_to_keep is the completion width, read-only)
SEED_KEYS: dict[str, str] = {
    "input_ids": "input_ids",
    "attention_mask": "attention_mask",
    "position_ids": "position_ids",
    "completion_mask": "completion_mask",
    "logits_to_keep": "logits_to_keep",
    "advantages": "advantages",
    "old_per_token_logps": "old_logps",
    "ref_per_token_logps": "ref_logps",
    "rollout_per_token_logps": "rollout_logps",
    "truncated_mask": "truncated",
    "num_items_in_batch": "num_items",
}


def collate(
    samples: list[EncodedSample], pad_id: int, truncated: list[bool], max_completion_length: int | None = None
) -> RolloutBatch:
    """Pad prompts on the left and completions on the right; positions count real tokens only."""
    if max_completion_length is not None:
        for s in samples:  # a multi-turn trajectory may exceed the total budget: cut it (the tail trains nothing)
            if len(s.completion_ids) > max_completion_length:
                if s.extra.get("images_end", 0) > max_completion_length:
                    raise RolloutError(
                        f"a trajectory of {len(s.completion_ids)} completion tokens has observation "
                        f"image tokens beyond --max_completion_length {max_completion_length}; "
                        "raise it, or end trajectories before their observations outgrow it"
                    )
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
            lps += (s.rollout_logprobs if s.rollout_logprobs is not None else [float("nan")] * c) + [
                float("nan")
            ] * right
    n, width = len(samples), p_len + c_len
    input_ids = torch.tensor(ids, dtype=torch.long).view(n, width)
    attention = torch.tensor(att, dtype=torch.long).view(n, width)
    rollout = torch.tensor(lps, dtype=torch.float32).view(n, c_len) if have_lps else None
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    mm = [s.extra.get("mm", MMRow()) for s in samples] if any("mm" in s.extra for s in samples) else None
    return RolloutBatch(
        input_ids,
        attention,
        position_ids,
        torch.tensor(cmask, dtype=torch.float32).view(n, c_len),
        torch.tensor(truncated, dtype=torch.bool),
        rollout_logps=rollout,
        mm_inputs=mm,
    )
