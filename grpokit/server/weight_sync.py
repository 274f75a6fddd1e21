"""Weight sync from the trainer to rollout servers over a ``torch.distributed`` group, without files.

The group is built *without* ``init_process_group`` (the trainer may already live in a torch.distributed world):
the trainer is rank 0 and hosts a ``TCPStore``; server ``i`` joins as rank ``i + 1``; the backend is
``ProcessGroupGloo`` on CPU or ``ProcessGroupNCCL`` when both ends hold their models on GPUs.

One sync = one ``POST /update_weights/`` per server carrying every bucket's metadata (names, dtypes, shapes,
byte offsets), then one broadcast per bucket of a flat ``uint8`` tensor of at most ``weight_sync_bucket_mb``
(a single tensor larger than that travels alone). Each tensor starts at a 16-byte aligned offset so that the
receiver can view the bytes as the tensor's dtype without a copy, then ``param.data.copy_`` it in place.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Sequence

import torch

from grpokit.errors import ServerError
from grpokit.server.bodies import InitCommunicatorBody, TensorMeta, UpdateWeightsBody, WeightBucket

logger = logging.getLogger(__name__)

ALIGN = 16  # bytes; covers every dtype's element size


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """A torch dtype from its wire name; ValueError for anything else."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(specs: Iterable[tuple[str, Sequence[int], torch.dtype]], bucket_bytes: int) -> list[WeightBucket]:
    """Group (name, shape, dtype) specs, in order, into buckets of at most ``bucket_bytes`` (aligned offsets).

    A tensor larger than ``bucket_bytes`` gets a bucket of its own.
    """
    buckets: list[WeightBucket] = []
    metas: list[TensorMeta] = []
    used = 0
    for name, shape, dtype in specs:
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        offset = _aligned(used)
        if metas and offset + nbytes > bucket_bytes:
            buckets.append(WeightBucket(nbytes=used, tensors=metas))
            metas, offset = [], 0
        metas.append(TensorMeta(name=name, dtype=dtype_name(dtype), shape=list(shape), offset=offset, nbytes=nbytes))
        used = offset + nbytes
    if metas:
        buckets.append(WeightBucket(nbytes=used, tensors=metas))
    return buckets


def pack(buf_B: torch.Tensor, meta: TensorMeta, tensor: torch.Tensor) -> None:
    """Write ``tensor`` (cast to the wire dtype) into the uint8 bucket ``buf_B`` at ``meta.offset``."""
    wire = tensor.to(device=buf_B.device, dtype=parse_dtype(meta.dtype)).contiguous().reshape(-1)
    buf_B[meta.offset:meta.offset + meta.nbytes].copy_(wire.view(torch.uint8))


def unpack(buf_B: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """A view of one tensor inside the uint8 bucket ``buf_B`` (no copy)."""
    raw = buf_B[meta.offset:meta.offset + meta.nbytes]
    return raw.view(parse_dtype(meta.dtype)).view(meta.shape)


def local_address_towards(host: str, port: int) -> str:
    """The address of this machine's interface that routes to ``host`` (no packet is sent)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class Communicator:
    """One side of the weight-sync group: a store connection and a gloo/nccl process group."""

    def __init__(self, store, pg, rank: int, world_size: int, backend: str, device: torch.device, where: str):
        self.store, self.pg, self.rank, self.world_size = store, pg, rank, world_size
        self.backend, self.device, self.where = backend, device, where

    @classmethod
    def create(cls, *, store_host: str, store_port: int, rank: int, world_size: int, backend: str, group: str,
               timeout_s: float, local_host: str, store=None) -> Communicator:
        """Rendezvous through the TCPStore at ``store_host:store_port``; raises ServerError naming it on failure.

        ``store`` is the already-listening master store on rank 0; other ranks connect to it.
        """
        import torch.distributed as dist

        where = f"{store_host}:{store_port}"
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if store is None:
                store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timeout,
                                      wait_for_workers=False)
            prefixed = dist.PrefixStore(f"grpokit-weight-sync/{group}", store)
            if backend == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
            else:
                device = torch.device("cpu")
                opts = dist.ProcessGroupGloo._Options()
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
                opts._timeout = timeout
                pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
        except Exception as e:  # noqa: BLE001 - c10d raises several types; all mean the rendezvous failed
            raise ServerError(f"weight sync: rendezvous of {world_size} ranks ({backend}) through the store at "
                              f"{where} failed after {timeout_s:g}s as rank {rank}: {_first_line(e)}") from e
        return cls(store, pg, rank, world_size, backend, device, where)

    def broadcast(self, buf_B: torch.Tensor) -> None:
        """Broadcast the flat bucket from rank 0 to every rank (blocking, bounded by the group's timeout)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            self.pg.broadcast([buf_B], opts).wait()
        except Exception as e:  # noqa: BLE001
            raise ServerError(f"weight sync: broadcast of {buf_B.numel()} bytes in the group at {self.where} "
                              f"failed: {_first_line(e)}") from e

    def close(self) -> None:
        for name in ("shutdown", "abort"):
            fn = getattr(self.pg, name, None)
            if fn is not None:
                try:
                    fn()
                    break
                except Exception:  # noqa: BLE001 - best effort on the way out
                    continue
        self.pg = self.store = None


class WeightReceiver:
    """Server side: joins the trainer's group, then receives buckets and hands the tensors to a loader."""

    def __init__(self) -> None:
        self.comm: Communicator | None = None
        self.group: str | None = None  # the trainer's session id, so that it can tell a stale group
        self._lock = threading.Lock()  # one sync or (re)init at a time

    @property
    def is_open(self) -> bool:
        return self.comm is not None

    def open(self, body: InitCommunicatorBody, device: torch.device) -> None:
        """Join the group (blocking until every rank has joined or the timeout passes); replaces an old group."""
        with self._lock:
            self._close_locked()
            if body.backend == "nccl" and device.type == "cuda":
                torch.cuda.set_device(device)
            self.comm = Communicator.create(
                store_host=body.host, store_port=body.port, rank=body.rank, world_size=body.world_size,
                backend=body.backend, group=body.group, timeout_s=body.timeout_s,
                local_host=local_address_towards(body.host, body.port))
            self.group = body.group
        logger.info("weight sync: joined the trainer's %s group at %s:%d as rank %d/%d",
                    body.backend, body.host, body.port, body.rank, body.world_size)

    def receive(self, body: UpdateWeightsBody, load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> int:
        """Receive every bucket of ``body`` and ``load`` its tensors; returns the number of tensors loaded.

        A failed broadcast closes the group: the trainer must call ``/init_communicator/`` again.
        """
        with self._lock:
            if self.comm is None:
                raise ServerError("no weight-sync group: POST /init_communicator/ first")
            comm = self.comm
            size = max((b.nbytes for b in body.buckets), default=0)
            buf_B = torch.empty(size, dtype=torch.uint8, device=comm.device)
            loaded = 0
            try:
                for bucket in body.buckets:
                    view_B = buf_B[:bucket.nbytes]
                    comm.broadcast(view_B)
                    load([(m.name, unpack(view_B, m)) for m in bucket.tensors])
                    loaded += len(bucket.tensors)
            except ServerError:
                self._close_locked()
                raise
            return loaded

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self.comm is not None:
            self.comm.close()
        self.comm = self.group = None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
