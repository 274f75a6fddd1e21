"""The weight group of ms-swift's design: the rollout server hosts the group's ``TCPStore`` and holds ranks
``0 .. world_size - 2``; the trainer joins last, as rank ``world_size - 1``, and broadcasts from there.

On GPUs the group is what ``swift rollout`` and its trainer build, vLLM's ``StatelessProcessGroup`` with a
``PyNcclCommunicator`` over it (so either side may be ms-swift's own). On CPU ``GlooCommunicator`` runs the same
message flow over gloo: it has ``PyNcclCommunicator``'s interface (``broadcast(tensor, src, stream)``, ``rank``,
``world_size``, ``device``, ``group.barrier()``), so ms-swift's client code drives it unchanged.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch

from grpokit.wire.group import first_line, local_address_towards, shut_down

WILDCARDS = ("0.0.0.0", "::", "")
STORE_PREFIX = "grpokit-swift-gloo"


@dataclass
class StoreGroup:
    """A rank of a group that talks through one ``TCPStore`` (the fields of vLLM's ``StatelessProcessGroup`` that
    ``GlooCommunicator`` reads)."""

    rank: int
    world_size: int
    store: object


class _GlooBarrier:
    def __init__(self, pg) -> None:
        self.pg = pg

    def barrier(self) -> None:
        self.pg.barrier().wait()


class GlooCommunicator:
    """``PyNcclCommunicator``'s interface over a gloo process group built on ``group.store`` (CPU tensors)."""

    def __init__(
        self, group, device: int | str | torch.device = "cpu", timeout_s: float = 300.0, local_host: str | None = None
    ) -> None:
        import torch.distributed as dist

        store = group.store
        if local_host is None:  # towards the store's host; on the store's own rank, bound to every interface,
            host = getattr(store, "host", "127.0.0.1")  # this machine's address
            wildcard = host in WILDCARDS
            local_host = socket.gethostbyname(socket.gethostname()) if wildcard else local_address_towards(host, 1)
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.device = group.rank, group.world_size, torch.device("cpu")
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), group.rank, group.world_size, opts)
        self.group = _GlooBarrier(self.pg)

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        shut_down(self.pg)


def open_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    device: torch.device | None = None,
    listen_host: str | None = None,
    local_host: str | None = None,
):
    """One rank of the group. Rank 0 hosts the store on ``listen_host`` (default ``host``), the others connect to
    ``host:port``; ``local_host``: the address gloo's peers reach this rank at (default: found from ``host``).
    Returns a communicator (``PyNcclCommunicator`` for ``backend`` nccl, else ``GlooCommunicator``);
    raises ``RuntimeError`` naming the store on failure."""
    try:
        if backend == "nccl":
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator  # vLLM: GPU servers only
            from vllm.distributed.utils import StatelessProcessGroup

            where = listen_host if rank == 0 and listen_host is not None else host
            pg = StatelessProcessGroup.create(
                host=where, port=port, rank=rank, world_size=world_size, store_timeout=int(timeout_s)
            )
            return PyNcclCommunicator(pg, device=device)
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            store = dist.TCPStore(
                listen_host or host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False
            )
        else:
            # counted as a worker: a store hosted by vLLM's StatelessProcessGroup waits for every rank to register
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        return GlooCommunicator(StoreGroup(rank, world_size, store), timeout_s=timeout_s, local_host=local_host)
    except Exception as e:  # noqa: BLE001 - c10d and vLLM raise several types; all mean the group did not form
        raise RuntimeError(
            f"weight sync ({backend}): rank {rank} of {world_size} could not form the group through the store at "
            f"{host}:{port}: {first_line(e)}"
        ) from e


def broadcast(comm, tensor: torch.Tensor, src: int) -> None:
    """``tensor`` from rank ``src`` to every rank, then the group's barrier (ms-swift's order)."""
    stream = torch.cuda.current_stream() if tensor.is_cuda else None
    comm.broadcast(tensor, src=src, stream=stream)
    if tensor.is_cuda:
        torch.cuda.synchronize()
    comm.group.barrier()
