"""One side of the weight-sync group: a ``TCPStore`` connection and a gloo/NCCL process group built without
``init_process_group``, so that it lives beside any torch.distributed world the process already has."""

from __future__ import annotations

import datetime
import socket

import torch

from grpokit.errors import ServerError


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
    def create(
        cls,
        *,
        store_host: str,
        store_port: int,
        rank: int,
        world_size: int,
        backend: str,
        group: str,
        timeout_s: float,
        local_host: str,
        store=None,
    ) -> Communicator:
        """Rendezvous through the TCPStore at ``store_host:store_port``; raises ServerError naming it on failure.

        ``store`` is the already-listening master store on rank 0; other ranks connect to it.
        """
        import torch.distributed as dist

        where = f"{store_host}:{store_port}"
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if store is None:
                store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timeout, wait_for_workers=False)
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
            raise ServerError(
                f"weight sync: rendezvous of {world_size} ranks ({backend}) through the store at "
                f"{where} failed after {timeout_s:g}s as rank {rank}: {first_line(e)}"
            ) from e
        return cls(store, pg, rank, world_size, backend, device, where)

    def broadcast(self, buf_B: torch.Tensor) -> None:
        """Broadcast the flat bucket from rank 0 to every rank (blocking, bounded by the group's timeout)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            self.pg.broadcast([buf_B], opts).wait()
        except Exception as e:  # noqa: BLE001
            raise ServerError(
                f"weight sync: broadcast of {buf_B.numel()} bytes in the group at {self.where} failed: {first_line(e)}"
            ) from e

    def close(self) -> None:
        shut_down(self.pg)
        self.pg = self.store = None


def shut_down(pg) -> None:
    """End a process group built here (``shutdown``, else ``abort``): best effort, on the way out."""
    for name in ("shutdown", "abort"):
        fn = getattr(pg, name, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:  # noqa: BLE001 - best effort on the way out
                continue


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
