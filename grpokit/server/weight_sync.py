"""Weight sync from the trainer to rollout servers over a ``torch.distributed`` group, without files.

The group is built *without* ``init_process_group`` (the trainer may already live in a torch.distributed world):
the trainer is rank 0 and hosts a ``TCPStore``; server ``i`` joins as rank ``i + 1``; the backend is
``ProcessGroupGloo`` on CPU or ``ProcessGroupNCCL`` when both ends hold their models on GPUs.

One sync = one ``POST /update_weights/`` per server carrying every bucket's metadata (names, dtypes, shapes,
byte offsets), then one broadcast per bucket of a flat ``uint8`` tensor of at most ``weight_sync_bucket_mb``
(a single tensor larger than that travels alone). Each tensor starts at a 16-byte aligned offset so that the
receiver can view the bytes as the tensor's dtype without a copy, then ``param.data.copy_`` it in place.

The metadata is validated whole before any broadcast (``bodies.py`` and the served engine's ``check_weights``).
The receiver's rendezvous runs in a thread of its own under a server-side deadline (c10d can wait forever on a
store that accepts and never answers), and its lock covers only the swap of a finished group.
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


class RendezvousBusy(ServerError):
    """Earlier rendezvous attempts are still stuck (their peer never answered): no new one is started."""


class _Attempt:
    """One rendezvous in a daemon thread. c10d can block past its own timeout (a store address that accepts the
    connection and never answers), so the caller waits on its own deadline; an attempt given up on closes its
    group itself if it ever completes."""

    def __init__(self, receiver: WeightReceiver, body: InitCommunicatorBody, device: torch.device, timeout_s: float):
        self.done = threading.Event()
        self.comm: Communicator | None = None
        self.error: BaseException | None = None
        self.abandoned = False
        self._receiver = receiver
        self._args = (body, device, timeout_s)
        threading.Thread(target=self._run, daemon=True, name=f"grpokit-rendezvous-{body.group[:16]}").start()

    def _run(self) -> None:
        body, device, timeout_s = self._args
        try:
            if body.backend == "nccl" and device.type == "cuda":
                torch.cuda.set_device(device)
            self.comm = Communicator.create(
                store_host=body.host, store_port=body.port, rank=body.rank, world_size=body.world_size,
                backend=body.backend, group=body.group, timeout_s=timeout_s,
                local_host=local_address_towards(body.host, body.port))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting request
            self.error = e
        with self._receiver._lock:
            self._receiver._pending.discard(self)
            self.done.set()
            orphan = self.comm if self.abandoned else None
        if orphan is not None:
            orphan.close()


class WeightReceiver:
    """Server side: joins the trainer's group, then receives buckets and hands the tensors to a loader.

    ``_lock`` guards only the swap of ``comm``/``group`` (never held while waiting on the network), so that
    ``close`` answers at once whatever a rendezvous or a sync is doing; ``_sync`` lets one sync run at a time.
    """

    MAX_PENDING = 2  # rendezvous threads still running (stuck on a silent peer) before new ones are refused
    GRACE_S = 1.0  # beyond the group's own timeout, before the server gives up waiting for c10d

    def __init__(self, max_timeout_s: float = 300.0) -> None:
        self.comm: Communicator | None = None
        self.group: str | None = None  # the trainer's session id, so that it can tell a stale group
        self.max_timeout_s = max_timeout_s
        self._lock = threading.Lock()
        self._sync = threading.Lock()
        self._pending: set[_Attempt] = set()
        self._busy: dict[int, int] = {}  # id(comm) -> syncs using it; a comm closed meanwhile is closed by the last
        self._retired: set[int] = set()

    @property
    def is_open(self) -> bool:
        return self.comm is not None

    def timeout_for(self, body: InitCommunicatorBody) -> float:
        return min(body.timeout_s, self.max_timeout_s)

    def open(self, body: InitCommunicatorBody, device: torch.device) -> None:
        """Join the group, waiting at most the capped timeout (+ a second); replaces an old group."""
        timeout_s = self.timeout_for(body)
        with self._lock:
            if len(self._pending) >= self.MAX_PENDING:
                raise RendezvousBusy(f"weight sync: {len(self._pending)} earlier rendezvous have not returned (their "
                                     "store never answered); retry later, or restart the server")
            attempt = _Attempt(self, body, device, timeout_s)
            self._pending.add(attempt)
        if not attempt.done.wait(timeout_s + self.GRACE_S):
            with self._lock:
                if not attempt.done.is_set():
                    attempt.abandoned = True
                    raise ServerError(f"weight sync: rendezvous with the store at {body.host}:{body.port} did not "
                                      f"finish within {timeout_s:g}s as rank {body.rank}; the store does not "
                                      "answer (check the trainer's address and its firewall)")
        if attempt.error is not None:
            if isinstance(attempt.error, ServerError):
                raise attempt.error
            raise ServerError(f"weight sync: rendezvous with {body.host}:{body.port} failed: "
                              f"{_first_line(attempt.error)}") from attempt.error
        with self._lock:
            old, self.comm, self.group = self.comm, attempt.comm, body.group
            self._retire_locked(old)
        logger.info("weight sync: joined the trainer's %s group at %s:%d as rank %d/%d",
                    body.backend, body.host, body.port, body.rank, body.world_size)

    def receive(self, body: UpdateWeightsBody, load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> int:
        """Receive every bucket of ``body`` and ``load`` its tensors; returns the number of tensors loaded.

        A failed broadcast closes the group: the trainer must call ``/init_communicator/`` again.
        """
        with self._sync:
            with self._lock:
                comm = self.comm
                if comm is None:
                    raise ServerError("no weight-sync group: POST /init_communicator/ first")
                self._busy[id(comm)] = self._busy.get(id(comm), 0) + 1
            try:
                return self._receive(comm, body, load)
            except ServerError:
                with self._lock:
                    if self.comm is comm:
                        self.comm = self.group = None
                        self._retire_locked(comm)
                raise
            finally:
                with self._lock:
                    self._busy[id(comm)] -= 1
                    last = not self._busy[id(comm)]
                    if last:
                        del self._busy[id(comm)]
                    close_now = last and id(comm) in self._retired
                    if close_now:
                        self._retired.discard(id(comm))
                if close_now:
                    comm.close()

    @staticmethod
    def _receive(comm: Communicator, body: UpdateWeightsBody, load) -> int:
        size = max((b.nbytes for b in body.buckets), default=0)
        buf_B = torch.empty(size, dtype=torch.uint8, device=comm.device)
        loaded = 0
        for bucket in body.buckets:
            view_B = buf_B[:bucket.nbytes]
            comm.broadcast(view_B)
            load([(m.name, unpack(view_B, m)) for m in bucket.tensors])
            loaded += len(bucket.tensors)
        return loaded

    def close(self) -> None:
        """Drop the group at once; a sync still using it closes it when it ends."""
        with self._lock:
            old, self.comm, self.group = self.comm, None, None
            self._retire_locked(old)

    def _retire_locked(self, comm: Communicator | None) -> None:
        if comm is None:
            return
        if self._busy.get(id(comm)):
            self._retired.add(id(comm))
        else:
            comm.close()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
