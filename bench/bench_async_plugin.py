"""bench_async.py's plugin (``--external_plugins``), loaded by both of its processes.

In the rollout server (``grpokit rollout --external_plugins``): a long-tail workload. Every sampled row
(temperature > 0; the weight-sync check's greedy probe is left alone) gets a completion length drawn from a
heavy-tailed distribution and ends exactly there: EOS is masked before that length and forced at it. The length
is a hash of the row's prompt ids, its index among the rows of that prompt and a seed, so every mode of one
benchmark (sync, K = 1, 2, 4) gets the same lengths for the same prompts. The tokens are really decoded by the
served model; only where EOS falls is decided here. The distribution (environment, set by bench_async.py):

- ``GRPOKIT_BENCH_LONG_FRACTION`` (0.1): rows that run to the request's ``max_tokens`` (EOS never sampled:
  finish_reason ``length``);
- ``GRPOKIT_BENCH_SHORT_MEAN`` (``max_tokens / 8``): the others' mean length (geometric, at most
  ``max_tokens - 1``);
- a row that a weight update paused (``--partial_rollouts``) keeps its length when it continues: the continuation's
  prompt is the row's prompt plus its tokens so far, which the plugin recognises and counts from (also when a
  continuation is paused again after one token: the update, the check's read-back and its probe each pause);
- ``GRPOKIT_BENCH_LENGTH_SEED`` (0); ``GRPOKIT_BENCH_LONGTAIL=0`` turns the workload off (lengths as sampled);
  ``GRPOKIT_BENCH_LENGTH_LOG=FILE`` appends each generate call's drawn lengths to FILE (to check that two modes
  drew the same).

In the trainer: ``step_stamps`` (a callback writing each optimizer step's end time to ``step_stamps.txt``) and the
``token_parity`` reward (varies within every group, so advantages are not all zero and every step trains).
"""

from __future__ import annotations

import hashlib
import math
import os
import time

import torch
from transformers import LogitsProcessor

from grpokit.rewards import ORM, orms
from grpokit.trainers.callbacks import TrainerCallback, callbacks_map


def target_length(
    prompt_ids: list[int], k: int, max_tokens: int, long_fraction: float, short_mean: float, seed: int
) -> int:
    """The completion length (EOS included) of the ``k``-th row of this prompt; ``max_tokens + 1`` means the row
    runs to the limit without EOS."""
    digest = hashlib.blake2b(f"{seed}|{k}|{','.join(map(str, prompt_ids))}".encode(), digest_size=16).digest()
    u1 = int.from_bytes(digest[:8], "little") / 2**64
    u2 = (int.from_bytes(digest[8:], "little") + 0.5) / 2**64
    if u1 < long_fraction:
        return max_tokens + 1
    p = 1.0 / max(short_mean, 1.0)  # geometric on 1, 2, ... with this mean, by inversion
    length = 1 + int(math.log(u2) / math.log1p(-p)) if p < 1 else 1
    return min(length, max_tokens - 1) if max_tokens > 1 else 1


# a row's ids so far (prompt + tokens, no padding) -> (its target length, tokens it had): the rows of the latest
# calls, so that a continuation (those ids as its prompt) keeps the row's length; bounded, oldest dropped first
_RUNNING: dict[tuple[int, ...], tuple[int, int]] = {}
_RUNNING_MAX = 4096


class ForcedLengths(LogitsProcessor):
    """EOS (and the pad token, where the engine ends a row too) masked before each row's target length, EOS
    forced at it (``target_length``)."""

    def __init__(self, prompt_width: int, max_tokens: int, eos: int, pad: int) -> None:
        self.width, self.max_tokens, self.eos, self.pad = prompt_width, max_tokens, eos, pad
        self.long_fraction = float(os.environ.get("GRPOKIT_BENCH_LONG_FRACTION", "0.1"))
        self.short_mean = float(os.environ.get("GRPOKIT_BENCH_SHORT_MEAN", max_tokens / 8))
        self.seed = int(os.environ.get("GRPOKIT_BENCH_LENGTH_SEED", "0"))
        self.targets: torch.Tensor | None = None
        self.before: list[int] = []  # per row, the tokens a paused row had before this call
        self.keys: list[tuple[int, ...] | None] = []

    def _targets(self, prompts: torch.Tensor) -> torch.Tensor:
        seen: dict[tuple[int, ...], int] = {}
        out = []
        self.keys = []
        for row in prompts.tolist():
            start = 0
            while start < len(row) and row[start] == self.pad:  # left padding depends on the batch: not the prompt
                start += 1
            key = tuple(row[start:])
            # a paused row continued: its own length, counted from where it stopped (the last call saw its ids up to
            # the token before the one it sampled last)
            if key[:-1] in _RUNNING:
                target, had = _RUNNING.pop(key[:-1])
                out.append(target - had - 1)
                self.before.append(had + 1)
                # a continuation paused again after its first token (the update, the check's read-back and its
                # probe each pause) comes back with these ids plus that token: it continues from here
                _RUNNING[key] = (target, had + 1)
                self.keys.append(key)
                continue
            k = seen[key] = seen.get(key, -1) + 1
            out.append(target_length(list(key), k, self.max_tokens, self.long_fraction, self.short_mean, self.seed))
            self.before.append(0)
            self.keys.append(None)
        return torch.tensor(out, device=prompts.device)

    def _remember(self, input_ids: torch.LongTensor, t: int) -> None:
        """Each running row's ids so far, with its length: what a continuation after a pause starts from."""
        for i, row in enumerate(input_ids.tolist()):
            if self.keys[i] is not None:
                _RUNNING.pop(self.keys[i], None)
            start = 0
            while start < self.width and row[start] == self.pad:
                start += 1
            key = tuple(row[start:])
            self.keys[i] = key
            _RUNNING[key] = (int(self.targets[i]) + self.before[i], self.before[i] + t)
        while len(_RUNNING) > _RUNNING_MAX:
            _RUNNING.pop(next(iter(_RUNNING)))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.targets is None:
            self.targets = self._targets(input_ids[:, : self.width])
            if os.environ.get("GRPOKIT_BENCH_LENGTH_LOG"):
                with open(os.environ["GRPOKIT_BENCH_LENGTH_LOG"], "a") as f:
                    f.write(f"{self.targets.tolist()}\n")
        t = input_ids.shape[1] - self.width  # tokens generated so far: this call picks token t + 1
        if t > 0:
            self._remember(input_ids, t)
        scores = scores.clone()
        early = self.targets > t + 1
        scores[early, self.eos] = float("-inf")
        scores[early, self.pad] = float("-inf")  # the engine ends a row at a sampled pad token too
        at = self.targets == t + 1
        if bool(at.any()):
            scores[at] = float("-inf")
            scores[at, self.eos] = 0.0
        return scores


class _WithForcedLengths:
    """Wraps a transformers engine's logits-processor factory: its processors, then ``ForcedLengths``."""

    def __init__(self, inner, eos: int, pad: int) -> None:
        self.inner, self.eos, self.pad = inner, eos, pad

    def __call__(self, config, prompt_width: int):
        procs = list(self.inner(config, prompt_width) or []) if self.inner is not None else []
        if config.temperature > 0:
            procs.append(ForcedLengths(prompt_width, config.max_tokens, self.eos, self.pad))
        return procs or None


def _install() -> None:
    """The served transformers engine samples with forced lengths (vLLM's engine is not patched)."""
    from grpokit.server import engine as served

    original = served.ServedTransformersEngine.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.logits_processor_factory = _WithForcedLengths(
            self.logits_processor_factory, self.template.eos_token_id, self.template.pad_token_id
        )

    served.ServedTransformersEngine.__init__ = __init__


class StepStamps(TrainerCallback):
    def on_step_end(self, trainer):
        with open(trainer.output_dir / "step_stamps.txt", "a") as f:
            f.write(f"{time.perf_counter()}\n")


class TokenParity(ORM):
    def __call__(self, completions, completion_ids, **kwargs):
        return [float(sum(ids) % 2) for ids in completion_ids]


if os.environ.get("GRPOKIT_BENCH_LONGTAIL", "1") != "0":
    _install()
callbacks_map["step_stamps"] = StepStamps
orms["token_parity"] = TokenParity
