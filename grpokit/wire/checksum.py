"""Checksums of synced weights, computed the same way on both sides of a weight sync.

A tensor's checksum is three float64 sums over its flat values in the wire dtype: ``Σx``, ``Σ|x|`` and
``Σ w_i·x_i`` with a position weight ``w_i = 1 + (i mod 1021) / 1021``, so that a changed, zeroed, stale, shifted
or transposed tensor changes at least one of them. The sums run on the tensor's device, a chunk at a time (no
float64 copy of a whole tensor), and a caller stacks every tensor's [3] sums and moves them to the host once.

Two sides add the same values in different orders (other devices, other reduction kernels), so sums agree to
float64 rounding, not bit for bit: ``sums_agree`` allows ``RTOL_SAME`` of ``Σ|x|``, or the receiving dtype's
epsilon where the receiver holds the value in a narrower dtype than the wire's (the cast rounds every element).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

PERIOD = 1021  # a prime: the position weights of rows of any power-of-two width differ
CHUNK = PERIOD * 4096  # elements summed at once (a whole number of periods): bounds the temporaries
RTOL_SAME = 1e-12  # float64 sums of the same values in another order: n · 2^-53 relative at worst for n ≤ 2^40,
# far less for the pairwise/tree reductions torch uses; a one-element change of 1e-12 · Σ|x| is still caught
SUMS = ("sum", "abs_sum", "weighted_sum")


def _ramp(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device, dtype=torch.float64)


def tensor_sums(t: torch.Tensor) -> torch.Tensor:
    """[3] float64 on ``t``'s device: Σx, Σ|x|, Σ w_i·x_i over ``t``'s flat values, ``w_i = 1 + (i mod P)/P``
    (no host sync). Two passes over the values: their float64 column sums and those of |x|, the values laid out
    P to a row; Σx is the columns' total and Σw·x = Σx + (1/P)·Σ_k k·(column k's sum), so no weight vector as long
    as the tensor is made."""
    flat = t.detach().reshape(-1)
    if not flat.is_floating_point():
        flat = flat.to(torch.float64)
    ramp = _ramp(PERIOD, flat.device)
    out = torch.zeros(3, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), CHUNK):
        c = flat[start : start + CHUNK]
        whole = c.numel() // PERIOD * PERIOD
        rest = c[whole:].to(torch.float64)
        if whole:
            columns = c[:whole].view(-1, PERIOD).sum(0, dtype=torch.float64)
            out[0] += columns.sum()
            out[1] += c[:whole].abs().view(-1, PERIOD).sum(0, dtype=torch.float64).sum()
            out[2] += columns.dot(ramp) / PERIOD
        out[0] += rest.sum()
        out[1] += rest.abs().sum()
        out[2] += rest.dot(ramp[: rest.numel()]) / PERIOD
    out[2] += out[0]
    return out


class SumsOf:
    """Checksums of many tensors, moved to the host together: ``add(t)`` per tensor, then ``values()`` -> one
    ``[Σx, Σ|x|, Σw·x]`` list per tensor, in order."""

    def __init__(self) -> None:
        self._rows: list[torch.Tensor] = []

    def add(self, t: torch.Tensor) -> None:
        self._rows.append(tensor_sums(t))

    def values(self) -> list[list[float]]:
        if not self._rows:
            return []
        devices = {r.device for r in self._rows}
        rows = self._rows if len(devices) == 1 else [r.cpu() for r in self._rows]
        return torch.stack(rows).cpu().tolist()


def rtol_for(wire_dtype: torch.dtype, held_dtype: torch.dtype) -> float:
    """The relative tolerance of a value sent as ``wire_dtype`` and held as ``held_dtype``: float64 rounding when
    the held dtype keeps every wire value exactly, else the held dtype's epsilon (the cast rounded each value)."""
    if held_dtype == wire_dtype or not held_dtype.is_floating_point or not wire_dtype.is_floating_point:
        return RTOL_SAME
    held, wire = torch.finfo(held_dtype), torch.finfo(wire_dtype)
    if held.bits >= wire.bits and held.eps <= wire.eps and held.max >= wire.max:  # e.g. bf16 or fp16 into fp32
        return RTOL_SAME
    return float(held.eps)


def sums_agree(expected: Sequence[float | None], held: Sequence[float], rtol: float) -> bool:
    """Whether the receiver's sums match the sender's. A sender's sum that is not finite (None on the wire, a
    diverged weight) is not compared; the step guard deals with such weights."""
    scale = abs(held[1]) if math.isfinite(held[1]) else 0.0
    if expected[1] is not None:
        scale = max(scale, abs(expected[1]))
    for k, (e, h) in enumerate(zip(expected, held, strict=True)):
        if e is None:
            continue
        if not math.isfinite(h):
            return False
        tol = rtol * scale * (2.0 if k == 2 else 1.0) + 1e-30  # weights are below 2
        if abs(e - h) > tol:
            return False
    return True


def finite_or_none(sums: Sequence[float]) -> list[float | None]:
    """The sums as the wire carries them: JSON has no NaN/inf, so a non-finite sum travels as null."""
    return [float(s) if math.isfinite(s) else None for s in sums]


def _fmt(x: float | None) -> str:
    return "nan/inf" if x is None or not math.isfinite(x) else f"{x:.9g}"


def _worst(expected: Sequence[float | None], held: Sequence[float]) -> int:
    """The sum that differs most (a non-finite held sum first)."""
    gaps = [
        -1.0 if e is None else math.inf if not math.isfinite(h) else abs(e - h)
        for e, h in zip(expected, held, strict=True)
    ]
    return max(range(len(gaps)), key=gaps.__getitem__)


def compare_sums(
    sent: Sequence[tuple[int | None, str, torch.dtype, Sequence[float | None]]],
    held: dict[str, tuple[Sequence[float], torch.dtype] | None],
    n_buckets: int = 0,
) -> tuple[list[str], int, int]:
    """The receiver's sums against the sender's: (one problem per bucket that differs, tensors compared,
    tensors the receiver cannot read back). ``sent`` rows are (bucket index or None, name, wire dtype, sums);
    ``held`` maps a name to the receiver's (sums, dtype it holds the tensor in), None where it cannot read the
    tensor back (e.g. a backend that repacked it), and lacks names the receiver does not hold at all."""
    bad: dict[int | None, list[str]] = {}
    sizes: dict[int | None, int] = {}
    checked = unreadable = 0
    for bucket, name, wire, sums in sent:
        sizes[bucket] = sizes.get(bucket, 0) + 1
        if name not in held:
            bad.setdefault(bucket, []).append(f"{name} is not held at all (dropped)")
            continue
        got = held[name]
        if got is None:
            unreadable += 1
            continue
        checked += 1
        if not sums_agree(sums, got[0], rtol_for(wire, got[1])):
            k = _worst(sums, got[0])
            bad.setdefault(bucket, []).append(f"{name} ({SUMS[k]} {_fmt(got[0][k])}, sent {_fmt(sums[k])})")
    problems = []
    for bucket, names in bad.items():
        where = "" if bucket is None else f"bucket {bucket} of {n_buckets}: "
        if len(names) > 1 and len(names) == sizes[bucket]:
            head = f"every one of its {len(names)} tensors differs (was it loaded?), e.g. {names[0]}"
        else:
            head = names[0] + (f" and {len(names) - 1} more of its {sizes[bucket]} tensors" if len(names) > 1 else "")
        problems.append(where + head)
    return problems, checked, unreadable
