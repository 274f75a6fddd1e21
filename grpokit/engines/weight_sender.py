"""Trainer side of weight sync (the receiving side is ``grpokit.server.weight_sync.WeightReceiver``).

``WeightSender.sync(model)``: check the plan with every server (``dry_run``), (re)build the group when a server
does not hold ours, then post the bucket metadata to every server in background threads while this thread
packs and broadcasts the buckets one by one. Any failure closes the group (the next sync builds a new one) and
raises ``ServerError``; nothing waits longer than the timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from grpokit.engines.adapters import AdapterUpdate
from grpokit.engines.weights import gathers_on_every_rank, iter_sync_weights, named_sync_tensors, sync_shape
from grpokit.errors import ServerError
from grpokit.wire.bodies import MAX_SYNC_TIMEOUT_S, InitCommunicatorBody, UpdateWeightsBody, WeightBucket
from grpokit.wire.checksum import SumsOf
from grpokit.wire.group import Communicator, local_address_towards
from grpokit.wire.weights import pack, plan_buckets, unpack

logger = logging.getLogger(__name__)

# post(server_index, path, json_body, timeout_s) -> parsed JSON answer; raises ServerError
PostFn = Callable[[int, str, dict, float], Any]


class _Background:
    """Calls running in daemon threads; results collected by key, the first error re-raised."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()
        self._expected = 0
        self.results: dict[Any, Any] = {}

    def start(self, key: Any, fn: Callable[[], Any]) -> None:
        def run() -> None:
            try:
                self._q.put((key, True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                self._q.put((key, False, e))

        self._expected += 1
        threading.Thread(target=run, daemon=True, name=f"grpokit-sync-{key}").start()

    def poll(self) -> None:
        """Collect what has finished; raise the first error at once."""
        while True:
            try:
                self._take(self._q.get_nowait())
            except queue.Empty:
                return

    def wait(self, timeout_s: float, what: str) -> dict[Any, Any]:
        deadline = time.monotonic() + timeout_s
        while len(self.results) < self._expected:
            try:
                self._take(self._q.get(timeout=max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                raise ServerError(f"weight sync: {what} did not finish within {timeout_s:.0f}s") from None
        return self.results

    def _take(self, item: tuple[Any, bool, Any]) -> None:
        key, ok, value = item
        if not ok:
            raise value
        self.results[key] = value


class WeightSender:
    """Pushes a model's weights to one or several rollout servers (trainer = rank 0, server i = rank i + 1)."""

    def __init__(
        self, endpoints: list[tuple[str, int]], post: PostFn, bucket_mb: int, timeout_s: float, interrupt: bool = False
    ) -> None:
        if bucket_mb < 1:
            raise ServerError(f"--weight_sync_bucket_mb {bucket_mb}: must be at least 1")
        self.endpoints = endpoints
        self.post = post
        self.interrupt = interrupt  # --partial_rollouts: each update pauses the servers' running generation
        self.bucket_bytes = bucket_mb * 1024 * 1024
        self.timeout_s = timeout_s
        self.comm: Communicator | None = None
        self.group: str | None = None

    # -- public --------------------------------------------------------------------------------------------
    def sync(self, model, wire_dtype: torch.dtype | None = None, backend: str = "gloo") -> int:
        """Send every weight of ``model`` (LoRA merged) to every server; returns the number of tensors sent."""
        return sum(len(b.tensors) for b in self.sync_summed(model, wire_dtype, backend)[0])

    def sync_summed(
        self,
        model,
        wire_dtype: torch.dtype | None = None,
        backend: str = "gloo",
        sums: SumsOf | None = None,
        version: int | None = None,
        adapter: AdapterUpdate | None = None,
    ) -> tuple[list[WeightBucket], dict[int, Any]]:
        """``sync``, returning the buckets sent and each server's answer; with ``sums``, every tensor's checksums
        are taken over the bytes as packed for the broadcast (on the bucket's device), in bucket order;
        ``version``: the trainer's weight version, which the servers tag their samples with; ``adapter``: an
        adapter-only sync (engines/adapters.py), the base left out where every server holds it already."""
        buckets = self._plan(adapter.tensors(model) if adapter else named_sync_tensors(model), wire_dtype)
        check = UpdateWeightsBody(buckets=buckets, dry_run=True).model_dump()
        groups = self._each_server("/update_weights/", lambda i: check, "checking the weight names")
        if adapter is not None and all(g.get("adapter_base") == adapter.base_id for g in groups.values()):
            adapter = dataclasses.replace(adapter, base=False)
            buckets = self._plan(adapter.tensors(model), wire_dtype)
        if (
            self.comm is None
            or self.comm.backend != backend
            or any(g.get("group") != self.group for g in groups.values())
        ):
            self._open(backend)
        try:
            return buckets, self._send(model, buckets, sums, version, adapter)
        except BaseException:
            self.close(notify=False)  # the servers' receive fails once our end is gone; they drop their groups
            raise

    def close(self, notify: bool = True) -> None:
        """Drop the group; with ``notify``, tell the servers to drop theirs (best effort)."""
        if notify and self.comm is not None:
            for i in range(len(self.endpoints)):
                try:
                    self.post(i, "/close_communicator/", {}, min(self.timeout_s, 10.0))
                except ServerError as e:
                    logger.warning("weight sync: could not close the group on a server: %s", e)
        if self.comm is not None:
            self.comm.close()
        self.comm = self.group = None

    # -- internals -----------------------------------------------------------------------------------------
    def _plan(self, named, wire_dtype: torch.dtype | None) -> list[WeightBucket]:
        specs = [(name, sync_shape(t), _wire(t.dtype, wire_dtype)) for name, t in named]
        return plan_buckets(specs, self.bucket_bytes)

    def _each_server(self, path: str, body: Callable[[int], dict], what: str) -> dict[int, Any]:
        calls = _Background()
        for i in range(len(self.endpoints)):
            calls.start(i, lambda i=i: self.post(i, path, body(i), self.timeout_s))
        return calls.wait(self.timeout_s + 5, what)

    def _open(self, backend: str) -> None:
        import datetime

        import torch.distributed as dist

        self.close(notify=False)
        host0, port0 = self.endpoints[0]
        host = os.environ.get("GRPOKIT_WEIGHT_SYNC_HOST") or local_address_towards(host0, port0)
        world = 1 + len(self.endpoints)
        group = uuid.uuid4().hex
        try:
            store = dist.TCPStore(
                host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=self.timeout_s)
            )
        except Exception as e:  # noqa: BLE001
            raise ServerError(
                f"weight sync: cannot open a TCPStore on {host} (set GRPOKIT_WEIGHT_SYNC_HOST to an "
                f"address of this machine that the servers reach): {e}"
            ) from e
        port = store.port
        calls = _Background()
        calls.start(
            "trainer",
            lambda: Communicator.create(
                store_host=host,
                store_port=port,
                rank=0,
                world_size=world,
                backend=backend,
                group=group,
                timeout_s=self.timeout_s,
                local_host=host,
                store=store,
            ),
        )
        for i in range(len(self.endpoints)):
            body = InitCommunicatorBody(
                host=host,
                port=port,
                rank=i + 1,
                world_size=world,
                backend=backend,
                group=group,
                timeout_s=min(self.timeout_s, MAX_SYNC_TIMEOUT_S),
            ).model_dump()
            calls.start(i, lambda i=i, body=body: self.post(i, "/init_communicator/", body, self.timeout_s + 5))
        results = calls.wait(self.timeout_s + 10, f"the rendezvous at {host}:{port}")
        self.comm, self.group = results["trainer"], group
        logger.info("weight sync: %s group of %d ranks at %s:%d", backend, world, host, port)

    def _send(self, model, buckets: list[WeightBucket], sums: SumsOf | None, version: int | None, adapter=None):
        comm = self.comm
        body = UpdateWeightsBody(
            buckets=buckets, version=version, interrupt=self.interrupt, adapter=adapter.body() if adapter else None
        ).model_dump()
        calls = _Background()
        for i in range(len(self.endpoints)):
            calls.start(i, lambda i=i: self.post(i, "/update_weights/", body, self.timeout_s))
        size = max((b.nbytes for b in buckets), default=0)
        buf_B = torch.empty(size, dtype=torch.uint8, device=comm.device)  # reused by every bucket
        weights = adapter.tensors(model) if adapter is not None else iter_sync_weights(model)
        try:
            for bucket in buckets:
                view_B = buf_B[: bucket.nbytes]
                for meta in bucket.tensors:
                    name, tensor = next(weights)
                    if name != meta.name:
                        raise ServerError(
                            f"weight sync: the model's parameters changed during the sync "
                            f"({name!r} where {meta.name!r} was planned)"
                        )
                    pack(view_B, meta, tensor)
                    if sums is not None:
                        sums.add(unpack(view_B, meta))  # what goes on the wire, read back from the buffer
                calls.poll()  # a server that refused the update: stop before broadcasting into nothing
                comm.broadcast(view_B)
        finally:
            weights.close()  # ends an open gather (and undoes a DoRA layer's merge)
        return calls.wait(self.timeout_s + 5, "loading the weights on the servers")


def _wire(dtype: torch.dtype, server_dtype: torch.dtype | None) -> torch.dtype:
    """Floating weights travel in the server's dtype (half the bytes for a bf16 server); others unchanged."""
    if server_dtype is not None and dtype.is_floating_point and server_dtype.is_floating_point:
        return server_dtype
    return dtype


def sends_here(model) -> bool:
    """True on the process that pushes weights to the servers (rank 0, or no torch.distributed world). Another
    rank of a sharded model (FSDP2, ZeRO-3) runs the gathers that rank 0's sync needs, then returns False."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        return True
    if gathers_on_every_rank(model):
        for _ in iter_sync_weights(model):
            pass
    return False
