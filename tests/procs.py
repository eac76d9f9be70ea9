"""Real OS processes for tests: `pagedserve` subcommands on free ports, with health waits.

`ServerProcess` is the benchmarks' process wrapper (`benchmarks.common.Process`) with the tests'
defaults; `free_port` is `pagedserve.ports.free_port`, here for the tests that import it."""

from __future__ import annotations

import os
import subprocess
import threading
import time

from benchmarks.common import Process
from pagedserve.grpc_security import INSECURE, GrpcSecurity
from pagedserve.ports import free_port

__all__ = ["STARTUP_S", "ServerProcess", "drain", "free_port", "read_until"]

# How long a process may take to come up before it counts as hung. On a quiet machine a worker
# is ready in seconds; a shared one at a load of 25 took over two minutes just to import torch.
# A process that exits is reported at once, whatever this is.
STARTUP_S = 300.0


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


class ServerProcess(Process):
    """`pagedserve <args>` with one torch thread (`env` is added to the process's environment;
    a None value takes the variable out); `security` is what its health check needs (TLS: the
    token is not needed for health); it is ready when the health service at `ready_address`
    names `ready_service` SERVING (a control plane's "liveness": up, with or without workers).
    Its log is kept, and named at `stop`, with PAGEDSERVE_KEEP_TEST_LOGS set."""

    def __init__(
        self,
        name: str,
        args: list[str],
        ready_address: str,
        env: dict[str, str | None] | None = None,
        security: GrpcSecurity = INSECURE,
        ready_service: str = "",
    ) -> None:
        super().__init__(
            name,
            args,
            {"OMP_NUM_THREADS": "1", **(env or {})},
            log_prefix="",
            keep_log=bool(os.environ.get("PAGEDSERVE_KEEP_TEST_LOGS")),
        )
        self.address = ready_address
        self.security = security
        self.ready_service = ready_service

    def wait_ready(self, timeout: float = STARTUP_S) -> None:
        self.wait_serving(self.address, timeout, self.security, self.ready_service)

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
