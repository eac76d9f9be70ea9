"""A whole stack for gateway tests: redis-server, a worker, the control plane and the HTTP
gateway as real processes, started once per test session and shared by the modules that ask.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.procs import STARTUP_S, ServerProcess, free_port
from tests.redis_proc import RedisServer
from tests.stack import Stack, start_stack

API_KEY = "test-key"


class HttpProcess(ServerProcess):
    """A `pagedserve` HTTP server: ready once GET /health answers at all (200 or 503)."""

    def __init__(
        self, name: str, args: list[str], url: str, env: dict[str, str] | None = None
    ) -> None:
        super().__init__(name, args, ready_address=url, env=env)
        self.url = url

    def wait_ready(self, timeout: float = STARTUP_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early:\n{self.output()[-4000:]}")
            try:
                httpx.get(f"{self.url}/health", timeout=2)
                return
            except httpx.TransportError:
                time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready:\n{self.output()[-4000:]}")


def gateway_process(control_plane: str, *args: str) -> HttpProcess:
    """A gateway in front of the control plane at `control_plane` on a free port, ready; the
    caller stops it."""
    url = f"http://127.0.0.1:{free_port()}"
    argv = ["gateway", "--port", url.rsplit(":", 1)[1], "--control-plane", control_plane]
    gw = HttpProcess("gateway", [*argv, *args], url)
    try:
        gw.wait_ready()
    except BaseException:
        gw.stop()
        raise
    return gw


class Processes:
    """Processes stopped together, the last started first."""

    def __init__(self) -> None:
        self.stoppers: list[ServerProcess | RedisServer] = []

    def spawn(self, name: str, *args: str, ready_address: str, **kw: Any) -> ServerProcess:
        """Same signature as the `spawn` fixture, so it works with tests.stack.start_stack."""
        p = ServerProcess(name, list(args), ready_address, **kw)
        self.stoppers.append(p)
        p.wait_ready()
        return p

    def gateway(
        self, control_plane: str, *args: str, env: dict[str, str] | None = None
    ) -> HttpProcess:
        port = free_port()
        argv = ["gateway", "--port", str(port), "--control-plane", control_plane, *args]
        p = HttpProcess("gateway", argv, f"http://127.0.0.1:{port}", env)
        self.stoppers.append(p)
        p.wait_ready()
        return p

    def redis(self) -> RedisServer:
        r = RedisServer()
        self.stoppers.append(r)
        return r

    def stop_all(self) -> None:
        for p in reversed(self.stoppers):
            p.stop()
        self.stoppers.clear()


@dataclass
class GatewayStack:
    stack: Stack
    gateway: HttpProcess
    api_key: str
    redis_url: str | None
    processes: Processes

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def all_blocks_free(self) -> bool:
        w = self.stack.stats().workers[0]
        return w.num_free_gpu_blocks == w.num_gpu_blocks

    def wait_all_blocks_free(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.all_blocks_free():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True


_shared: GatewayStack | None = None


def shared_gateway_stack(config: pytest.Config, model_dir: Path) -> GatewayStack:
    """One stack (with API keys on) for every gateway test module in the session."""
    global _shared
    if _shared is None:
        procs = Processes()
        config.add_cleanup(procs.stop_all)
        redis_url = procs.redis().url if shutil.which("redis-server") else None
        cp_args = ("--redis-url", redis_url) if redis_url else ()
        stack = start_stack(procs.spawn, model_dir, cp_args=cp_args)
        gw = procs.gateway(stack.address, "--api-key", API_KEY)
        _shared = GatewayStack(stack, gw, API_KEY, redis_url, procs)
    return _shared
