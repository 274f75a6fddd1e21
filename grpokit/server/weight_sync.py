"""The rollout server's side of weight sync: ``WeightReceiver`` joins the trainer's group and copies the buckets
it receives into the served model. The wire format and the group itself are in ``grpokit.wire``.

The receiver's rendezvous runs in a thread of its own under a server-side deadline (c10d can wait forever on a
store that accepts and never answers), and its lock covers only the swap of a finished group. At the deadline the
attempt's connections to that store are shut down (Linux: found through /proc), so its thread ends and no silent
store can hold a rendezvous slot: the trainer's next init always gets one.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import torch

from grpokit.errors import ServerError
from grpokit.wire.bodies import CheckWeightsBody, InitCommunicatorBody, UpdateWeightsBody
from grpokit.wire.checksum import compare_sums
from grpokit.wire.group import Communicator, first_line, local_address_towards
from grpokit.wire.weights import parse_dtype, unpack

logger = logging.getLogger(__name__)


def _proc_hex(ip: str) -> str | None:
    """An address as /proc/net/tcp(6) writes it (32-bit words in host byte order, hex), or None."""
    try:
        raw = ipaddress.ip_address(ip).packed
    except ValueError:
        return None
    return "".join(raw[i : i + 4][::-1].hex().upper() for i in range(0, len(raw), 4))


def shutdown_connections_to(host: str, port: int) -> int:
    """Shut down this process's TCP connections to ``host:port`` (so that a thread blocked reading one returns);
    the number shut. Linux only (0 elsewhere, or when the name does not resolve)."""
    try:
        ips = {info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except OSError:
        return 0
    mapped = {f"::ffff:{ip}" for ip in ips if ":" not in ip}  # an IPv6 socket reaching an IPv4 address
    remotes = {f"{h}:{port:04X}" for h in map(_proc_hex, ips | mapped) if h}
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[2] in remotes:
                inodes.add(f"socket:[{fields[9]}]")
    shut = 0
    for fd in os.listdir("/proc/self/fd") if inodes else ():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") not in inodes:
                continue
            with socket.socket(fileno=os.dup(int(fd))) as sock:
                sock.shutdown(socket.SHUT_RDWR)
            shut += 1
        except OSError:
            continue
    return shut


class RendezvousBusy(ServerError):
    """Earlier rendezvous attempts are still stuck (their peer never answered): no new one is started."""


class _Attempt:
    """One rendezvous in a daemon thread. c10d can block past its own timeout (a store address that accepts the
    connection and never answers), so the caller waits on its own deadline; an attempt given up on closes its
    group itself if it ever completes, and its store connections are shut down once its deadline has passed."""

    def __init__(self, receiver: WeightReceiver, body: InitCommunicatorBody, device: torch.device, timeout_s: float):
        self.done = threading.Event()  # the thread ended
        self.wake = threading.Event()  # the waiter stops waiting: the thread ended, or the attempt was superseded
        self.comm: Communicator | None = None
        self.error: BaseException | None = None
        self.abandoned = False
        self.superseded = False  # a newer init took its place
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s + receiver.GRACE_S
        self.host, self.port = body.host, body.port
        self._receiver = receiver
        self._args = (body, device, timeout_s)
        threading.Thread(target=self._run, daemon=True, name=f"grpokit-rendezvous-{body.group[:16]}").start()

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def _run(self) -> None:
        body, device, timeout_s = self._args
        try:
            if body.backend == "nccl" and device.type == "cuda":
                torch.cuda.set_device(device)
            self.comm = Communicator.create(
                store_host=body.host,
                store_port=body.port,
                rank=body.rank,
                world_size=body.world_size,
                backend=body.backend,
                group=body.group,
                timeout_s=timeout_s,
                local_host=local_address_towards(body.host, body.port),
            )
        except BaseException as e:  # noqa: BLE001 - handed to the waiting request
            self.error = e
        with self._receiver._lock:
            self._receiver._pending.discard(self)
            self.done.set()
            self.wake.set()
            orphan = self.comm if self.abandoned else None
        if orphan is not None:
            orphan.close()

    def reap(self, tries: int = 3) -> None:
        """After the deadline: shut the attempt's store connections, so that a c10d call blocked on a silent store
        returns and the thread ends; again a second later while it lives (up to ``tries`` times). Skipped while the
        group in use or a rendezvous still waited on talks to the same address (their connections look alike)."""
        if self.done.is_set():
            return
        wait = self.deadline - time.monotonic()
        if wait > 0:
            _timer(wait, self.reap, tries)
            return
        receiver = self._receiver
        with receiver._lock:  # never cut the group in use, nor a newer rendezvous with the same store
            in_use = (receiver.comm is not None and receiver.comm.where == self.where) or any(
                a.where == self.where and not a.abandoned for a in receiver._pending
            )
        if not in_use:
            shutdown_connections_to(self.host, self.port)
        if tries > 1:
            _timer(1.0, self.reap, tries - 1)


def _timer(delay_s: float, fn, *args) -> None:
    t = threading.Timer(delay_s, fn, args)
    t.daemon = True
    t.start()


class WeightReceiver:
    """Server side: joins the trainer's group, then receives buckets and hands the tensors to a loader.

    ``_lock`` guards only the swap of ``comm``/``group`` (never held while waiting on the network), so that
    ``close`` answers at once whatever a rendezvous or a sync is doing; ``_sync`` lets one sync run at a time.
    """

    MAX_PENDING = 2  # rendezvous waited on at once; a new one gives up the oldest
    MAX_STUCK = 16  # rendezvous threads alive, given-up ones included (they end at their deadline): more get 429
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
        """Join the group, waiting at most the capped timeout (+ a second); replaces an old group. With
        ``MAX_PENDING`` rendezvous already waited on, the oldest is given up for this one (a new init from the
        trainer wins over a stale one)."""
        timeout_s = self.timeout_for(body)
        with self._lock:
            waiting = sorted((a for a in self._pending if not a.abandoned), key=lambda a: a.started)
            stale = waiting[: max(0, len(waiting) - self.MAX_PENDING + 1)]
            for given_up in stale:
                given_up.superseded = given_up.abandoned = True
                given_up.wake.set()
        for given_up in stale:
            given_up.reap()  # at its deadline
        with self._lock:
            if len(self._pending) >= self.MAX_STUCK:
                raise RendezvousBusy(
                    f"weight sync: {len(self._pending)} earlier rendezvous have not returned (their "
                    "store never answered); retry in a few seconds"
                )
            attempt = _Attempt(self, body, device, timeout_s)
            self._pending.add(attempt)
        attempt.wake.wait(timeout_s + self.GRACE_S)
        with self._lock:
            finished = attempt.done.is_set() and not attempt.superseded
            if not finished:
                attempt.abandoned = True
            orphan = attempt.comm if not finished and attempt.done.is_set() else None
        if orphan is not None:  # completed just as it was given up: nobody else closes it
            orphan.close()
        if not finished:
            attempt.reap()  # now that its deadline has passed, or later for a superseded one
            if attempt.superseded:
                raise ServerError(
                    f"weight sync: the rendezvous with {body.host}:{body.port} was given up for a "
                    "newer POST /init_communicator/"
                )
            raise ServerError(
                f"weight sync: rendezvous with the store at {body.host}:{body.port} did not finish "
                f"within {timeout_s:g}s as rank {body.rank}; the store does not answer (check the "
                "trainer's address and its firewall)"
            )
        if attempt.error is not None:
            if isinstance(attempt.error, ServerError):
                raise attempt.error
            raise ServerError(
                f"weight sync: rendezvous with {body.host}:{body.port} failed: {first_line(attempt.error)}"
            ) from attempt.error
        with self._lock:
            old, self.comm, self.group = self.comm, attempt.comm, body.group
            self._retire_locked(old)
        logger.info(
            "weight sync: joined the trainer's %s group at %s:%d as rank %d/%d",
            body.backend,
            body.host,
            body.port,
            body.rank,
            body.world_size,
        )

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
            view_B = buf_B[: bucket.nbytes]
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


def check_held(body: CheckWeightsBody, weight_sums: Callable[[list[str]], dict], max_problems: int = 8) -> dict:
    """The answer of ``POST /check_weights/``: the sums the trainer took over the bytes it sent, against the
    sums of the weights the engine holds now (``weight_sums(names)``, read back from its parameters); one
    problem per bucket that differs, at most ``max_problems`` of them, and ``count`` of all."""
    sent = [(b, m.name, parse_dtype(m.dtype), m.sums) for b, bucket in enumerate(body.buckets) for m in bucket]
    held = weight_sums([name for _, name, _, _ in sent])
    problems, checked, unreadable = compare_sums(sent, held, len(body.buckets))
    return {
        "ok": not problems,
        "problems": problems[:max_problems],
        "count": len(problems),
        "checked": checked,
        "unreadable": unreadable,
    }
