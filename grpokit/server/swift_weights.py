"""The rollout server's side of ms-swift's weight routes (grpokit/wire/swift_group.py has the group's design).

As in ``swift rollout``, the routes answer at once and the work runs in order on one worker thread (there, vLLM's
workers reading their pipe): ``/init_communicator/`` hosts the store and waits for the trainer to join,
``/update_named_param/`` and ``/update_flattened_params/`` receive a broadcast and load it, and
``/process_weights_after_loading/`` waits for all of that, so its answer carries any failure (a 424 naming it).
Every wait is bounded by ``--max_sync_timeout_s``. The checks that need no broadcast (names, shapes, dtypes, bucket
size against the served model and ``--max_weight_bucket_mb``) answer 4xx before anything is queued.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from grpokit.errors import ServerError
from grpokit.server import adapter_updates
from grpokit.wire.bodies import AdapterBody, TensorMeta, UpdateWeightsBody
from grpokit.wire.swift import SwiftFlattenedBody, SwiftNamedParamBody, swift_dtype
from grpokit.wire.swift_group import broadcast, open_group
from grpokit.wire.weights import unpack

logger = logging.getLogger(__name__)


class QueueFull(ServerError):
    """Too many weight-sync steps wait on the worker (answered 429)."""


def tensor_metas(body: SwiftFlattenedBody | SwiftNamedParamBody) -> list[TensorMeta]:
    """ms-swift's weight metadata as grpokit's (what the served engine's ``check_weights`` reads)."""
    if isinstance(body, SwiftNamedParamBody):
        size = torch.empty((), dtype=getattr(torch, swift_dtype(body.dtype))).element_size()
        nbytes = size
        for d in body.shape:
            nbytes *= d
        return [TensorMeta(name=body.name, dtype=swift_dtype(body.dtype), shape=body.shape, offset=0, nbytes=nbytes)]
    return [
        TensorMeta(name=m.name, dtype=swift_dtype(m.dtype), shape=m.shape, offset=m.start_idx, nbytes=m.numel)
        for m in body.metadatas
    ]


def swift_adapter_name(name: str) -> str:
    """ms-swift's adapter tensor name (peft's state-dict key, ``base_model.model.`` first, maybe the adapter's name
    after ``lora_A``) as grpokit's wire name."""
    name = name.removeprefix("base_model.model.")
    for factor in ("lora_A", "lora_B"):
        head, sep, tail = name.partition(f".{factor}.")
        if sep and tail != "weight" and tail.endswith(".weight"):
            name = f"{head}.{factor}.weight"  # lora_A.default.weight
    return name


class SwiftWeightGroup:
    """ms-swift's weight group on the server: rank 0 of ``world_size`` (one server rank + the trainer)."""

    GRACE_S = 5.0  # beyond the group's timeout, before a wait for a queued step gives up

    def __init__(self, state) -> None:
        self.state = state
        count = getattr(state.engine, "tensor_count", None)  # ms-swift may send every tensor on its own
        self.max_queued = max(1024, 2 * count()) if callable(count) else 1024
        self.comm = None
        self.world_size = 0
        self.error: str | None = None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="grpokit-swift-weights")
        self._queued: list[Future] = []
        self._lock = threading.Lock()

    @property
    def opened(self) -> bool:
        """A group was asked for (it may still be forming on the worker)."""
        return self.world_size > 0

    def _submit(self, fn, *args) -> None:
        def run() -> None:
            if self.error is not None:
                return  # an earlier step failed: the rest of this sync is void, finish() reports that step
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - kept for the next answer that waits (finish)
                self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                logger.warning("weight sync (ms-swift routes): %s", self.error)
                self._drop()

        with self._lock:
            self._queued = [f for f in self._queued if not f.done()]
            if len(self._queued) >= self.max_queued:
                raise QueueFull(
                    f"{len(self._queued)} weight-sync steps are waiting for the trainer's broadcasts; retry once "
                    "they are done (POST /process_weights_after_loading/ waits for them)"
                )
            self._queued.append(self._worker.submit(run))

    def open(self, host: str, port: int, world_size: int, backend: str, device, local_host: str) -> None:
        """Queue the rendezvous (the store listens on ``host``); a group already held is closed first."""
        self.close()
        self.error, self.world_size = None, world_size
        timeout = self.state.options.max_sync_timeout_s

        def form() -> None:
            self.comm = open_group(
                host, port, 0, world_size, backend, timeout, device=device, listen_host=host, local_host=local_host
            )
            logger.info("weight sync (ms-swift routes): the trainer joined the %s group at %s:%d", backend, host, port)

        self._submit(form)

    def receive(self, body: SwiftNamedParamBody | SwiftFlattenedBody) -> None:
        """Queue one broadcast from the trainer (the last rank) and the load of what it carries."""
        metas = tensor_metas(body)
        nbytes = max(m.offset + m.nbytes for m in metas)

        def run() -> None:
            if self.comm is None:
                raise ServerError("no weight-sync group: POST /init_communicator/ first")
            buf_B = torch.empty(nbytes, dtype=torch.uint8, device=self.comm.device)
            broadcast(self.comm, buf_B, src=self.world_size - 1)
            with self.state.engine.lock:
                self.state.engine.load_weights([(m.name, unpack(buf_B, m)) for m in metas])

        self._submit(run)

    def receive_adapter(self, body: SwiftFlattenedBody, spec: AdapterBody) -> None:
        """Queue ms-swift's ``/update_adapter_flattened_param/``: one broadcast of the adapter's factors, loaded
        as a new LoRA version over the model as the server loaded it (server/adapter_updates.py)."""
        metas = [m.model_copy(update={"name": swift_adapter_name(m.name)}) for m in tensor_metas(body)]
        nbytes = max(m.offset + m.nbytes for m in metas)
        update = UpdateWeightsBody(buckets=[], adapter=spec)

        def run() -> None:
            if self.comm is None:
                raise ServerError("no weight-sync group: POST /init_communicator/ first")
            buf_B = torch.empty(nbytes, dtype=torch.uint8, device=self.comm.device)
            broadcast(self.comm, buf_B, src=self.world_size - 1)
            engine = self.state.engine
            with engine.lock:
                adapter_updates.begin(engine, update, self.state.weight_version + 1, [m.name for m in metas])
                try:
                    engine.load_weights([(m.name, unpack(buf_B, m)) for m in metas])
                except BaseException:
                    adapter_updates.end(engine, update, ok=False)
                    raise
                adapter_updates.end(engine, update, ok=True)

        self._submit(run)

    def finish(self, timeout_s: float) -> None:
        """Wait for every queued step; ServerError with the first failure. The engine then serves the new weights
        (its prefix cache dropped) and the weight version advances."""
        with self._lock:
            queued = list(self._queued)
        for f in queued:  # each step is bounded by the group's own timeout; this wait only backs that up
            f.result(timeout=timeout_s + self.GRACE_S)
        error, self.error = self.error, None
        if error is not None:
            raise ServerError(f"{error}; the weight-sync group is closed, POST /init_communicator/ again")
        with self.state.engine.lock:
            self.state.engine.reset_prefix_cache()  # a vLLM engine loads a partial sync's tensors here
        self.state.weight_version += 1

    def _drop(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None and hasattr(comm, "close"):
            comm.close()

    def close(self) -> None:
        """Close the group (queued after the steps already asked for, as in ms-swift)."""
        if self.opened:
            self.world_size = 0
            self._submit(self._drop)
