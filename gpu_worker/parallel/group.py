"""One rank's place in its tensor-parallel group and the group's collectives, over
torch.distributed on loopback (gloo on CPU; NCCL for the activations on CUDA)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gpu_worker.models.shard import Shard

# A collective that waits longer than this (a rank hung, not dead) fails the step.
COLLECTIVE_TIMEOUT_S = 60.0

LOOPBACK = "127.0.0.1"
_IFF_LOOPBACK = 0x8  # linux/if.h


def loopback_interface() -> str:
    """The loopback interface's name: "lo" on Linux, "lo0" on macOS."""
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        try:
            flags = int(Path(f"/sys/class/net/{name}/flags").read_text(), 16)
        except (OSError, ValueError):
            continue
        if flags & _IFF_LOOPBACK:
            return name
    return next((name for name in names if name.startswith("lo")), "lo")


def _listen(port: int) -> int:
    """A socket listening on LOOPBACK:port, handed over as its file descriptor."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(128)
    return sock.detach()


class TPGroup:
    """This rank's shard and the group's collectives (a `models.base.TensorParallel`)."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.rank = shard.rank
        self.size = shard.size

    @classmethod
    def join(cls, shard: Shard, port: int, device: str = "cpu") -> TPGroup:
        """Joins the group whose store rank 0 serves on 127.0.0.1:`port`."""
        # On CUDA the activations go over NCCL; the few host tensors (token ids, the pool
        # size) over gloo. Both pick a non-loopback interface by default (the host name's
        # address): named here, their sockets stay on loopback.
        loopback = loopback_interface()
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
        os.environ["NCCL_SOCKET_IFNAME"] = loopback
        backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store = dist.TCPStore(
            LOOPBACK,
            port,
            world_size=shard.size,
            is_master=shard.rank == 0,
            timeout=timeout,
            wait_for_workers=False,
            # The store's own listener binds every interface; this one binds loopback, and
            # the store takes it over (detach: the fd is the store's to close).
            master_listen_fd=_listen(port) if shard.rank == 0 else None,
        )
        dist.init_process_group(
            backend, store=store, rank=shard.rank, world_size=shard.size, timeout=timeout
        )
        return cls(shard)

    @property
    def samples(self) -> bool:
        """Rank 0 samples (and keeps grammar matchers); the others take its tokens."""
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums t over the ranks, in place (half precision is summed in float32)."""
        if t.dtype in (torch.float32, torch.float64):
            dist.all_reduce(t)
        else:
            wide = t.float()
            dist.all_reduce(wide)
            t.copy_(wide)
        return t

    def min(self, value: int) -> int:
        """The smallest of every rank's value."""
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """[R, vocab_rows] on each rank -> [R, vocab] on each rank."""
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=1)[:, : self.shard.vocab_size]

    def broadcast_tokens(self, token_ids: list[int] | None, count: int) -> list[int]:
        """Rank 0's sampled token ids, on every rank."""
        t = (
            torch.tensor(token_ids, dtype=torch.long)
            if token_ids is not None
            else torch.empty(count, dtype=torch.long)
        )
        if count:
            dist.broadcast(t, src=0)
        return [int(x) for x in t.tolist()]
