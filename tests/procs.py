"""Real OS processes for tests: `pagedserve` subcommands on free ports, with health waits."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve import grpc_security
from pagedserve.grpc_security import INSECURE, GrpcSecurity


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_until(proc: subprocess.Popen[str], marker: str, timeout: float = 180.0) -> list[str]:
    """Lines of proc's output up to the first that holds `marker`, or up to its end or the
    timeout (a line in progress then is waited for)."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if marker in line:
            break
    return lines


def drain(proc: subprocess.Popen[str], lines: list[str]) -> None:
    """Keeps reading proc's output into `lines` in the background. A cluster whose output
    nobody reads stops once the pipe is full: its next log line blocks the process that
    writes it, and with it every request that process serves."""
    threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True).start()


class ServerProcess:
    """`env` is added to the process's environment (a None value takes the variable out);
    `security` is what its health check needs
    (TLS: the token is not needed for health); it is ready when the health service names
    `ready_service` SERVING (a control plane's "liveness": up, with or without workers)."""

    def __init__(
        self,
        name: str,
        args: list[str],
        ready_address: str,
        env: dict[str, str | None] | None = None,
        security: GrpcSecurity = INSECURE,
        ready_service: str = "",
    ) -> None:
        self.name = name
        self.address = ready_address
        self.security = security
        self.ready_service = ready_service
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
        full = {
            **os.environ,
            "PAGEDSERVE_LOG_FORMAT": "json",
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.cli", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in full.items() if v is not None},
        )

    def output(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        with grpc_security.channel(self.address, self.security) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited early:\n{self.output()[-4000:]}")
                try:
                    check = health_pb2.HealthCheckRequest(service=self.ready_service)
                    r = stub.Check(check, timeout=1)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready:\n{self.output()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if os.environ.get("PAGEDSERVE_KEEP_TEST_LOGS"):
            print(f"{self.name} log: {self.log.name}")
        else:
            os.unlink(self.log.name)
