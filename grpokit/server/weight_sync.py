"""The rollout server's side of weight sync: ``WeightReceiver`` joins the trainer's group and copies the buckets
it receives into the served model. The wire format and the group itself are in ``grpokit.wire``.

The receiver's rendezvous runs in a thread of its own under a server-side deadline (c10d can wait forever on a
store that accepts and never answers), and its lock covers only the swap of a finished group.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from grpokit.errors import ServerError
from grpokit.wire.bodies import InitCommunicatorBody, UpdateWeightsBody
from grpokit.wire.group import Communicator, first_line, local_address_towards
from grpokit.wire.weights import unpack

logger = logging.getLogger(__name__)


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
                              f"{first_line(attempt.error)}") from attempt.error
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
