"""`pagedserve up`: the local cluster as child processes, each log line prefixed with its name.

Starts the workers, then the control plane, waits until each reports SERVING on the standard
gRPC health service, prints the address, and on Ctrl-C (or SIGTERM) stops them in reverse
order, letting the control plane drain in-flight requests first.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

READY_TIMEOUT_S = 300.0


class Child:
    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, bufsize=1
        )
        self._pump = threading.Thread(target=self._prefix, daemon=True)
        self._pump.start()

    def _prefix(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            sys.stdout.write(f"{self.name:>14s} | {line}")
            sys.stdout.flush()

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._pump.join(timeout=2)


def wait_serving(address: str, child: Child, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with code {child.proc.returncode}")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{child.name} did not become healthy at {address} in {timeout:.0f}s")


def _passthrough(a: argparse.Namespace, names: list[str]) -> list[str]:
    argv: list[str] = []
    for name in names:
        value = getattr(a, name.replace("-", "_"))
        if value is not None:
            argv += [f"--{name}", str(value)]
    return argv


def run_cluster(a: argparse.Namespace, model_dir: str) -> int:
    env = {**os.environ, "PAGEDSERVE_LOG_FORMAT": os.environ.get("PAGEDSERVE_LOG_FORMAT", "json")}
    py = [sys.executable, "-m", "pagedserve.cli"]
    worker_flags = _passthrough(
        a,
        [
            "device",
            "dtype",
            "block-size",
            "kv-cache-memory",
            "gpu-memory-utilization",
            "swap-space",
            "attention-backend",
            "max-model-len",
            "num-threads",
            "served-model-name",
        ],
    )
    children: list[Child] = []

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        addresses = []
        for i in range(a.workers):
            port = a.worker_base_port + i
            addresses.append(f"{a.host}:{port}")
            children.append(
                Child(
                    f"worker-{i}",
                    py
                    + ["worker", "--model", model_dir, "--host", a.host, "--port", str(port)]
                    + worker_flags,
                    env,
                )
            )
        for child, address in zip(children, addresses, strict=True):
            wait_serving(address, child)
        cp_address = f"{a.host}:{a.grpc_port}"
        cp = Child(
            "control-plane",
            py
            + [
                "control-plane",
                "--host",
                a.host,
                "--port",
                str(a.grpc_port),
                "--workers",
                ",".join(addresses),
            ]
            + _passthrough(
                a,
                [
                    "max-num-seqs",
                    "max-num-batched-tokens",
                    "long-prefill-token-threshold",
                    "preemption",
                    "max-waiting",
                    "redis-url",
                    "served-model-name",
                ],
            ),
            env,
        )
        children.append(cp)
        wait_serving(cp_address, cp)
        print(
            f"pagedserve is up: control plane at {cp_address} (gRPC), model {model_dir}", flush=True
        )
        print(f"try: pagedserve generate --control-plane {cp_address} --prompt 'Hello'", flush=True)
        while all(c.proc.poll() is None for c in children):
            time.sleep(0.5)
        dead = [c.name for c in children if c.proc.poll() is not None]
        print(f"stopping: {', '.join(dead)} exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping (draining in-flight requests)", flush=True)
        return 0
    finally:
        for child in reversed(children):
            child.stop()
