"""A worker and a control plane as real processes, and a small client for tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpu_worker.checkpoint import load_config
from gpu_worker.kv_cache import CacheGeometry
from pagedserve import grpc_security
from pagedserve.grpc_security import INSECURE, GrpcSecurity
from protos.v1 import common_pb2
from protos.v1 import control_plane_pb2 as pb
from protos.v1 import control_plane_pb2_grpc as pb_grpc
from tests.procs import ServerProcess, free_port

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_for_blocks(model_dir: Path, num_blocks: int, dtype: str, block_size: int = 16) -> int:
    """Bytes of `num_blocks` KV blocks of a CPU worker (`dtype` may be "auto", as the worker
    resolves it)."""
    import torch

    from gpu_worker.config import AUTO, auto_dtype

    if dtype == AUTO:
        dtype = auto_dtype("cpu")
    mc = load_config(model_dir)
    geometry = CacheGeometry(
        num_layers=mc.num_hidden_layers,
        num_kv_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim,
        block_size=block_size,
        dtype=getattr(torch, dtype),
    )
    return num_blocks * geometry.bytes_per_block


@dataclass
class Stack:
    address: str
    workers: list[ServerProcess]
    control_plane: ServerProcess
    security: GrpcSecurity = INSECURE  # what the stub sends
    channel: grpc.Channel = field(init=False)
    stub: pb_grpc.ControlPlaneStub = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc_security.channel(self.address, self.security)
        self.stub = pb_grpc.ControlPlaneStub(self.channel)

    @property
    def worker(self) -> ServerProcess:
        return self.workers[0]

    def stats(self) -> pb.StatsResponse:
        return self.stub.Stats(pb.StatsRequest(), timeout=10)


def worker_cli_args(
    model_dir: Path, port: int, num_gpu_blocks: int, num_cpu_blocks: int, dtype: str
) -> list[str]:
    return [
        "worker",
        "--model", str(model_dir),
        "--port", str(port),
        "--dtype", dtype,
        "--kv-cache-memory", str(kv_bytes_for_blocks(model_dir, num_gpu_blocks, dtype)),
        "--swap-space", str(kv_bytes_for_blocks(model_dir, num_cpu_blocks, dtype)),
    ]  # fmt: skip


def start_stack(
    spawn: Callable[..., ServerProcess],
    model_dir: Path,
    *,
    num_gpu_blocks: int = 256,
    num_cpu_blocks: int = 256,
    dtype: str = "float32",
    num_workers: int = 1,
    redis_url: str | None = None,
    worker_args: tuple[str, ...] = (),
    cp_args: tuple[str, ...] = (),
    token: str | None = None,
    worker_env: dict[str, str | None] | None = None,
) -> Stack:
    """With a token, every process requires it (PAGEDSERVE_GRPC_TOKEN) and the stub sends it.
    `worker_env` adds to the workers' environment (None: removed)."""
    env = {"PAGEDSERVE_GRPC_TOKEN": token} if token else None
    workers = []
    for i in range(num_workers):
        wport = free_port()
        args = worker_cli_args(model_dir, wport, num_gpu_blocks, num_cpu_blocks, dtype)
        wenv = {**(env or {}), **(worker_env or {})} or None
        workers.append(
            spawn(f"worker-{i}", *args, *worker_args, ready_address=f"127.0.0.1:{wport}", env=wenv)
        )
    cport = free_port()
    redis_args = ("--redis-url", redis_url) if redis_url else ()
    cp = spawn(
        "control-plane",
        "control-plane",
        "--port",
        str(cport),
        "--workers",
        ",".join(w.address for w in workers),
        *redis_args,
        *cp_args,
        ready_address=f"127.0.0.1:{cport}",
        env=env,
    )
    return Stack(f"127.0.0.1:{cport}", workers, cp, GrpcSecurity(token=token))


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: str
    chunks: list[pb.GenerateResponse]


def sampling(**kw: Any) -> common_pb2.SamplingParams:
    stop = kw.pop("stop", [])
    stop_ids = kw.pop("stop_token_ids", [])
    return common_pb2.SamplingParams(stop=stop, stop_token_ids=stop_ids, **kw)


def request(prompt: str | list[int], **kw: Any) -> pb.GenerateRequest:
    req_id = kw.pop("request_id", "")
    kind = kw.pop("output_kind", pb.OUTPUT_KIND_DELTA)
    req = pb.GenerateRequest(request_id=req_id, sampling=sampling(**kw), output_kind=kind)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def greedy_to_length(
    stub: pb_grpc.ControlPlaneStub, prompt: list[int], max_tokens: int
) -> list[int]:
    """Greedy, ignore_eos: the output ids, which must run to max_tokens."""
    out = generate(stub, prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    assert out.finish_reason == "length"
    return out.token_ids


def generate(stub: pb_grpc.ControlPlaneStub, prompt: str | list[int], **kw: Any) -> Completion:
    chunks = list(stub.Generate(request(prompt, **kw), timeout=300))
    return Completion(
        token_ids=[t for c in chunks for t in c.token_ids],
        text="".join(c.text for c in chunks),
        finish_reason=chunks[-1].finish_reason,
        stop_reason=chunks[-1].stop_reason,
        chunks=chunks,
    )


def wait_all_free(stack: Stack, timeout: float = 1.0) -> pb.StatsResponse:
    """The stats once the (first) worker's KV blocks are all free, or at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        stats = stack.stats()
        w = stats.workers[0]
        if w.num_free_gpu_blocks == w.num_gpu_blocks or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)
