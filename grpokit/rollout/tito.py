"""Token in, token out: a multi-turn trajectory trains on the ids that were sampled, and each later turn is sampled
from the trajectory's own ids, never from a re-render of its text (``docs/multi_turn.md``, "Token in, token out").

Loop side (``TurnRecord``, one per trajectory in ``MultiTurnScheduler.run``'s locals): after each turn it notes the
ids the engine sampled from (``response.prompt_token_ids``) and how many of the ids it sampled the trajectory kept
(all of them, or the prefix a ``step()`` kept before inserting text), and, where the engine reads a text template,
pins the next turn's prompt to this turn's prompt + the turn's ids as trained + the template's text up to the next
reply (``ChatTemplate.pin_ids``; a processor template is pinned by ``turn_images.TrajectoryImages``). The record
travels in ``rollout_infos['tito']`` (so through a rollout server too): per turn ``[prompt_len, prompt_digest,
kept, kept_digest]``, digests of the ids as little-endian int64 (blake2b, 8 bytes).

Trainer side (``tito_metrics``): for each trajectory of the window's batch, the ids it trains (prompt, then
completion) must start with every turn's prompt ids, hold that turn's kept sampled ids right after them, end with
the last turn's, and train (mask 1) no token outside those sampled spans. A trajectory that breaks any of these is
one violation (``multi_turn/tito_violations``, with a warning naming the first); one without a record (a
scheduler that overrides ``run()``, an engine that reports no prompt ids) is counted in ``multi_turn/tito_unchecked``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)
RECORD_KEY = "tito"


def digest(ids: Sequence[int] | np.ndarray) -> str:
    """An 8-byte blake2b of token ids as little-endian int64 (the same on the rollout server and the trainer)."""
    return hashlib.blake2b(np.asarray(ids, dtype="<i8").tobytes(), digest_size=8).hexdigest()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


class TurnRecord:
    """One trajectory's record of what each turn sampled from and kept, and the pins of its later turns.

    ``template`` is pinned on only when the engine itself renders with it (``engine.template is template``) and it is
    a text template; a client of a single-turn rollout server renders each turn there, so nothing is pinned."""

    def __init__(self, template, engine) -> None:
        own = template is not None and getattr(engine, "template", None) is template
        self.template = template if own and not getattr(template, "multimodal", False) else None
        self.turns: list[list[Any]] = []
        self.complete = True  # every turn's prompt ids are known
        self._prompt: list[int] | None = None
        self._sampled: list[int] = []
        self._pinned: set[str] = set()

    def sampled(self, prompt_ids: Sequence[int] | None, token_ids: Sequence[int]) -> None:
        """A turn came back: the ids the engine sampled from (None: it did not say) and the ids it sampled."""
        self._prompt = list(prompt_ids) if prompt_ids is not None else None
        self.complete = self.complete and prompt_ids is not None
        self._sampled = list(token_ids)

    def kept(self, ids: Sequence[int]) -> None:
        """The turn's ids as they train; the sampled ids kept are the prefix both share."""
        if self._prompt is None:
            return
        k = common_prefix(ids, self._sampled)
        self.turns.append([len(self._prompt), digest(self._prompt), k, digest(self._sampled[:k])])

    def pin_next(self, request, turn_ids: Sequence[int], gap_ids: Sequence[int]) -> None:
        """The next turn of ``request`` is sampled from this turn's prompt + ``turn_ids`` + ``gap_ids``."""
        if self.template is None or self._prompt is None:
            return
        self.template.pin_ids(request.request_id, request.messages, self._prompt + list(turn_ids) + list(gap_ids))
        self._pinned.add(request.request_id)

    def infos(self) -> dict[str, Any]:
        return {RECORD_KEY: self.turns} if self.complete and self.turns else {}

    def close(self) -> None:
        for rid in self._pinned:
            self.template.unpin_ids(rid)
        self._pinned.clear()


def trajectory_violation(full: np.ndarray, prompt_len: int, trained: np.ndarray, record: Any) -> str | None:
    """Why the ids trained (``full``: prompt then completion; ``trained``: the completion's mask-1 positions as a
    bool array) are not the ids sampled plus the tokens inserted between turns, or None when they are. A row the
    trainer cut to --max_completion_length is checked up to the cut."""
    n = len(full)
    if not isinstance(record, list) or not 0 < len(record) <= n:
        return "its rollout_infos['tito'] record is malformed"
    allowed = np.zeros(n, dtype=bool)
    prev, end = 0, 0
    prefix, hashed = hashlib.blake2b(digest_size=8), 0  # the digest of full[:hashed], extended turn by turn: O(n)
    for t, entry in enumerate(record, 1):
        try:
            p, prompt_digest, k, kept_digest = entry
            p, k = int(p), int(k)
        except (TypeError, ValueError):
            return f"turn {t}: its rollout_infos['tito'] record is malformed"
        if p < 0 or k < 0:
            return f"turn {t}: its rollout_infos['tito'] record is malformed"
        if p > n:  # the turn lies beyond the trainer's cut
            end = p
            break
        if p >= prev:
            prefix.update(np.asarray(full[hashed:p], dtype="<i8").tobytes())
            hashed = p
        if p < prev or prefix.copy().hexdigest() != prompt_digest:
            return (
                f"turn {t} was sampled from {p} prompt ids that are not the ids trained before it (a "
                "re-rendered conversation, or another template or options on the sampling side)"
            )
        end = p + k
        if end <= n and digest(full[p:end]) != kept_digest:
            return f"turn {t}: the {k} ids it sampled are not the ids trained after its prompt"
        allowed[p:end] = True
        prev = end
    if end < n:
        return f"{n - end} ids follow the last turn's sampled ones"
    stray = np.nonzero(trained & ~allowed[prompt_len : prompt_len + len(trained)])[0]
    if len(stray):
        return f"completion token {int(stray[0])} is trained (mask 1) but was not sampled"
    return None


def tito_metrics(
    batch, outputs: Sequence, total: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
) -> dict[str, float]:
    """``multi_turn/tito_violations`` and ``multi_turn/tito_unchecked`` of a window: ``batch`` its encoded rows
    (``input_ids``, ``attention_mask``, ``completion_mask``, in ``outputs`` order), ``total`` sums a [2] count over
    processes. Warns with the first violation's reason."""
    counts = torch.zeros(2)
    first = None
    c_len = batch.completion_mask.shape[1]
    p_width = batch.input_ids.shape[1] - c_len
    if batch.input_ids.shape[0] == len(outputs):
        ids, att = batch.input_ids.cpu().numpy(), batch.attention_mask.cpu().numpy()
        mask = batch.completion_mask.cpu().numpy() > 0
        for i, o in enumerate(outputs):
            record = o.rollout_infos.get(RECORD_KEY)
            if record is None:
                counts[1] += 1
                continue
            p, c = int(att[i, :p_width].sum()), int(att[i, p_width:].sum())
            why = trajectory_violation(ids[i, p_width - p : p_width + c], p, mask[i, :c], record)
            if why is not None:
                counts[0] += 1
                first = first or f"request {o.request_id}: {why}"
    else:  # a _prepare_batch_inputs override changed the rows: nothing to line them up with
        counts[1] += len(outputs)
    if first is not None:
        logger.warning("multi-turn: %d trajectory(ies) train on other ids than were sampled; %s", int(counts[0]), first)
    violations, unchecked = total(counts).tolist()
    return {"multi_turn/tito_violations": violations, "multi_turn/tito_unchecked": unchecked}
