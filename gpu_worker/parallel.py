"""Tensor parallelism inside a worker: N rank processes on one host, each holding a shard of
the model and of the KV pool, Megatron-style.

    rank 0 (the worker the control plane sees: gRPC, Describe, the Execute stream)
      │ each plan's bytes, over a pipe to every other rank's stdin (`Followers`)
      ▼
    every rank: the same batch from the same plan, its shard of every layer:
      QKV and gate/up column-parallel (its heads, its intermediate columns),
      o_proj and down row-parallel (partial sums, one all-reduce each per layer),
      embedding and LM head vocab-parallel (an all-reduce of the embedded rows, an all-gather
      of the logits), its heads' share of the KV pool (same block ids on every rank)
      │
    rank 0 samples and broadcasts the sampled token ids; every rank appends them.

Collectives are gloo on CPU (NCCL on CUDA) with a time-out; plans travel over pipes, which
have none, so an idle group waits for ever and a group whose rank 0 dies sees end-of-file.
The ranks are always on one host, so everything the group listens on (rank 0's
torch.distributed store, gloo's and NCCL's sockets) listens on loopback only, whatever the
worker's --host: none of it asks who connects.
A rank that dies takes the group down: rank 0 exits when any other rank exits (`Followers`
watches them), and the others exit at end-of-file or when a collective fails.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpu_worker.models.config import ModelConfig
from pagedserve.log import get_logger

log = get_logger(__name__)

# A collective that waits longer than this (a rank hung, not dead) fails the step.
COLLECTIVE_TIMEOUT_S = 60.0
# Frames on a follower's stdin: kind (1 byte), payload length (4 bytes), payload.
_PLAN, _RESET, _STOP = 1, 2, 3
_HEADER = struct.Struct("<BI")


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


class TensorParallelError(ValueError):
    """The model cannot be split this way (said in one line, before anything starts)."""


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` holds: its query heads, KV heads (several ranks hold the same
    one when size exceeds the KV heads, as vLLM replicates them), intermediate columns and
    vocabulary rows (the last rank's padded with zero rows when the vocabulary does not
    divide)."""

    rank: int
    size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    intermediate: int
    vocab_rows: int
    vocab_size: int

    @classmethod
    def plan(cls, config: ModelConfig, rank: int, size: int) -> Shard:
        h, kv, n = config.num_attention_heads, config.num_key_value_heads, size
        if h % n:
            raise TensorParallelError(
                f"the model's {h} attention heads do not split over tensor-parallel size {n}"
            )
        if kv % n and n % kv:
            raise TensorParallelError(
                f"the model's {kv} KV heads do not split over tensor-parallel size {n} "
                "(nor does the size split over them)"
            )
        if config.intermediate_size % n:
            raise TensorParallelError(
                f"the model's intermediate size {config.intermediate_size} does not split over "
                f"tensor-parallel size {n}"
            )
        local_kv = max(1, kv // n)
        return cls(
            rank=rank,
            size=n,
            head_dim=config.head_dim,
            num_heads=h // n,
            num_kv_heads=local_kv,
            kv_head_start=rank * local_kv if kv >= n else rank * kv // n,
            intermediate=config.intermediate_size // n,
            vocab_rows=-(-config.vocab_size // n),
            vocab_size=config.vocab_size,
        )

    def layer_config(self, config: ModelConfig) -> ModelConfig:
        """The config a decoder layer of this shard is built from."""
        return replace(
            config,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate,
        )

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def slice(self, name: str, src: Any) -> torch.Tensor:
        """This shard's part of checkpoint tensor `name`; `src` is the tensor or a lazy slice
        of it (safetensors' `get_slice`), indexed so that only the part is read."""
        d = self.head_dim
        part = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start = self.vocab_start
            rows = src[start : min(self.vocab_size, start + self.vocab_rows)]
            pad = self.vocab_rows - rows.shape[0]
            return torch.cat([rows, rows.new_zeros(pad, *rows.shape[1:])]) if pad else rows
        if part == "q_proj":
            q0 = self.rank * self.num_heads * d
            return src[q0 : q0 + self.num_heads * d]
        if part in ("k_proj", "v_proj"):
            k0 = self.kv_head_start * d
            return src[k0 : k0 + self.num_kv_heads * d]
        if part == "o_proj":
            if name.endswith(".bias"):  # added once, by rank 0
                bias = src[:]
                return bias if self.rank == 0 else torch.zeros_like(bias)
            q0 = self.rank * self.num_heads * d
            return src[:, q0 : q0 + self.num_heads * d]
        if part in ("gate_proj", "up_proj"):
            i0 = self.rank * self.intermediate
            return src[i0 : i0 + self.intermediate]
        if part == "down_proj":
            i0 = self.rank * self.intermediate
            return src[:, i0 : i0 + self.intermediate]
        return src[:]


class TPGroup:
    """This rank's shard and the group's collectives."""

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


class Followers:
    """Rank 0's handle on ranks 1..N-1: their processes and the pipes plans go down."""

    def __init__(self, cfg: Any, size: int, port: int) -> None:
        self._procs: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()
        self._stopping = False
        config = pickle.dumps(cfg)
        for rank in range(1, size):
            cmd = [
                sys.executable, "-m", "pagedserve.child_exec", str(os.getpid()),
                sys.executable, "-m", "gpu_worker.parallel", str(rank), str(size), str(port),
            ]  # fmt: skip
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
            assert proc.stdin is not None
            proc.stdin.write(_HEADER.pack(0, len(config)) + config)
            proc.stdin.flush()
            self._procs.append(proc)

    def watch(self) -> None:
        """From now on, a rank that exits ends this process too: the group cannot compute
        without it, and the control plane must see the worker gone, not hung."""
        for rank, proc in enumerate(self._procs, start=1):
            threading.Thread(target=self._wait, args=(rank, proc), daemon=True).start()

    def _wait(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if self._stopping:
            return
        log.error("tensor_parallel_rank_exited", rank=rank, exit_code=code)
        os._exit(1)

    def send_plan(self, data: bytes) -> None:
        self._send(_PLAN, data)

    def send_reset(self) -> None:
        self._send(_RESET, b"")

    def stop(self) -> None:
        self._stopping = True
        try:
            self._send(_STOP, b"")
        except OSError:
            pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def _send(self, kind: int, data: bytes) -> None:
        frame = _HEADER.pack(kind, len(data)) + data
        with self._lock:
            for proc in self._procs:
                assert proc.stdin is not None
                proc.stdin.write(frame)
                proc.stdin.flush()


def _read_frame(stream: Any) -> tuple[int, bytes] | None:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    kind, length = _HEADER.unpack(header)
    data = stream.read(length)
    return (kind, data) if len(data) == length else None


def follow(rank: int, size: int, port: int) -> int:
    """A follower rank's life: its config, then plans until end-of-file or a stop."""
    from gpu_worker.server import build_worker
    from pagedserve import wire
    from pagedserve.heap import freeze_heap
    from protos.v1 import worker_pb2

    stdin = sys.stdin.buffer
    first = _read_frame(stdin)
    if first is None:
        return 1
    cfg = pickle.loads(first[1])
    assert cfg.tensor_parallel_size == size
    worker = build_worker(cfg, rank=rank, tp_port=port)
    freeze_heap()
    runner = worker.runner
    while (frame := _read_frame(stdin)) is not None:
        kind, data = frame
        if kind == _STOP:
            return 0
        if kind == _RESET:
            runner.reset()
            continue
        msg = worker_pb2.StepPlan()
        msg.ParseFromString(data)
        runner.execute(wire.plan_from_proto(msg))
    return 0  # rank 0 is gone


if __name__ == "__main__":
    try:
        sys.exit(follow(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])))
    except Exception as exc:  # a failed collective, a bad plan: the group cannot go on
        log.error("tensor_parallel_rank_failed", error=str(exc))
        sys.exit(1)
