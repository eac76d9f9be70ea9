"""`pagedserve up`: the local cluster as child processes, each log line prefixed with its name.

Starts redis-server (unless --redis-url names one), the workers, the control plane and the
HTTP gateway, in that order, waiting until each is healthy; prints the URL. Ctrl-C (or
SIGTERM) stops them in reverse order: the gateway first lets in-flight requests finish, then
the control plane drains, then the workers and Redis go.

Once up, a worker, redis-server or the control plane that exits is started again on its own
address after a back-off (`Child.supervise`); the others serve on meanwhile
(docs/architecture.md, faults, says what each exit costs). The gateway exiting stops the
cluster: nothing would answer HTTP.

Children run in process groups of their own, so a terminal's Ctrl-C reaches only this process
and the shutdown order holds; each child gets SIGTERM should this process die without cleaning
up. They stay in this process's session: where the kernel shares the CPU between sessions'
autogroups first, the worker's lowered model threads (`--nice`) then yield to the gateway and
the control plane as they should.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpu_worker.host_memory import available_bytes
from pagedserve import envs, grpc_security
from pagedserve.cli import devices
from pagedserve.grpc_security import INSECURE, GrpcSecurity
from pagedserve.log import resolve_format
from pagedserve.ports import free_port

READY_TIMEOUT_S = 300.0
# A child that exits is started again after these waits, one per exit in a row; one that ran
# STABLE_AFTER_S before exiting starts from the first wait again. A child that keeps failing
# at start thus costs a try every 30 s, never a busy loop.
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_AFTER_S = 60.0
# What serving does while each restartable child is down, said when it exits.
WHILE_DOWN = {
    "worker": "its requests go on on the other workers",
    "redis": "serving goes on, placed by load; the prefix index is rebuilt once it is back",
    "control-plane": "its requests fail; new ones are served once it is back and its workers "
    "have registered",
}


class Child:
    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], while_down: str = ""
    ) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.while_down = while_down
        self.failures = 0  # exits in a row, each within STABLE_AFTER_S of its start
        self.restart_at: float | None = None  # when an exited restartable child starts again
        self._start()

    def _start(self) -> None:
        self.started = time.monotonic()
        # Through child_exec, which makes the child die with this process: nothing runs
        # between fork and exec here (this process has gRPC's threads by then).
        guard = [sys.executable, "-m", "pagedserve.child_exec", str(os.getpid())]
        argv, env = self.argv, self.env
        self.proc = subprocess.Popen(
            [*guard, *argv],
            stdin=subprocess.DEVNULL,  # a background process group must not read the terminal
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            bufsize=1,
            process_group=0,
        )
        self._pump = threading.Thread(target=self._prefix, args=(self.proc,), daemon=True)
        self._pump.start()

    def _prefix(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(f"{self.name:>14s} | {line}")
            sys.stdout.flush()

    def supervise(self, now: float) -> None:
        """Restarts this child after it exited, each time after a longer back-off (reset once
        it has run STABLE_AFTER_S); logs both."""
        code = self.proc.poll()
        if code is None:
            return
        if self.restart_at is None:
            if now - self.started >= STABLE_AFTER_S:
                self.failures = 0
            delay = RESTART_BACKOFF_S[min(self.failures, len(RESTART_BACKOFF_S) - 1)]
            self.failures += 1
            self.restart_at = now + delay
            print(
                f"{self.name} exited with code {code}: restarting it in {delay:.0f} s "
                f"({self.while_down})",
                file=sys.stderr,
                flush=True,
            )
        elif now >= self.restart_at:
            self.restart_at = None
            self._pump.join(timeout=2)
            self._start()
            print(f"{self.name} restarted (pid {self.proc.pid})", file=sys.stderr, flush=True)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise StartupError(f"{self.name} exited with code {self.proc.returncode}")

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._pump.join(timeout=2)


class StartupError(RuntimeError):
    """A child of `up` exited, or did not become healthy, while the cluster started."""


# -- health checks (also `pagedserve healthcheck`) ------------------------------------------------


def grpc_serving(address: str, timeout: float = 1.0, security: GrpcSecurity = INSECURE) -> bool:
    """The standard grpc.health.v1 service at address reports SERVING."""
    with grpc_security.channel(address, security) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """GET url answers 2xx."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= int(resp.status) < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tcp_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_until(
    check: Callable[[], bool], child: Child, what: str, timeout: float = READY_TIMEOUT_S
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        child.check_alive()
        if check():
            return
        time.sleep(0.2)
    raise StartupError(f"{child.name} did not become healthy at {what} in {timeout:.0f}s")


def wait_serving(address: str, child: Child, timeout: float = READY_TIMEOUT_S) -> None:
    wait_until(lambda: grpc_serving(address), child, address, timeout)


# -- the cluster --------------------------------------------------------------------------------


def _passthrough(a: argparse.Namespace, names: list[str]) -> list[str]:
    argv: list[str] = []
    for name in names:
        value = getattr(a, name.replace("-", "_"))
        if value is True:
            argv.append(f"--{name}")
        elif value is not None and value is not False:
            argv += [f"--{name}", str(value)]
    return argv


WORKER_FLAGS = [
    "device",
    "dtype",
    "block-size",
    "kv-cache-memory",
    "gpu-memory-utilization",
    "swap-space",
    "attention-backend",
    "max-model-len",
    "num-threads",
    "no-adaptive-threads",
    "nice",
    "tensor-parallel-size",
    "warmup-batch-size",
    "served-model-name",
]
SCHEDULER_FLAGS = [
    "max-num-seqs",
    "max-num-batched-tokens",
    "long-prefill-token-threshold",
    "max-prefill-tokens-with-decodes",
    "preemption",
    "max-waiting",
    "max-queue-delay",
    "served-model-name",
    "no-prefix-caching",
    "no-async-scheduling",
    "worker-failover-timeout",
    "grammar-compile-timeout",
    "worker-connect-timeout",
    "worker-wait-timeout",
    "step-trace",
    "chat-template",
]
# One request's budget: the gateway checks an HTTP request's total, the control plane each call.
BUDGET_FLAGS = ["max-request-tokens", "max-logprob-entries"]
GATEWAY_FLAGS = [
    "max-request-bytes",
    "graceful-shutdown-timeout",
    "stream-stall-timeout",
    "http-header-timeout",
    "http-body-timeout",
    "max-connections",
]


def cpu_kv_share(workers: int, device: str, kv_cache_memory: int | None) -> int | None:
    """Each CPU worker's KV pool where several share this host and none was given: one
    default pool split between them (alone, each would size itself from the same free
    memory and together take it several times over). None: the worker sizes its own."""
    if workers < 2 or kv_cache_memory is not None or device.startswith("cuda"):
        return None
    from gpu_worker.config import default_kv_cache_memory  # with torch: only where needed

    return default_kv_cache_memory(available_bytes()) // workers


def _start_redis(a: argparse.Namespace, env: dict[str, str]) -> tuple[Child | None, str | None]:
    """redis-server on a free (or the given) port, or None when it is not installed: Redis
    only holds routing hints, so serving goes on without it."""
    binary = shutil.which("redis-server")
    if binary is None:
        print("redis-server not found: running without the prefix index", file=sys.stderr)
        return None, None
    port = a.redis_port or free_port(a.host)
    argv = [binary, "--bind", a.host, "--port", str(port), "--save", "", "--appendonly", "no"]
    child = Child("redis", argv, env, WHILE_DOWN["redis"])
    wait_until(lambda: tcp_open(a.host, port), child, f"{a.host}:{port}", timeout=30)
    return child, f"redis://{a.host}:{port}/0"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """SIGINT and SIGTERM both raise KeyboardInterrupt in the main thread, whatever handling
    this process inherited: a shell starts background jobs with SIGINT ignored, and
    `docker stop` or a parent's death sends SIGTERM. Every service then stops gracefully."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)


def run_until_signalled(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Runs an asyncio service until SIGINT or SIGTERM, either of which cancels it: its
    `finally` blocks then run at an await, with the event loop intact. (A KeyboardInterrupt
    raised by a signal handler can land inside one of the loop's callbacks, after which a gRPC
    server may never finish stopping.) The loop is uvloop's, as the gateway's: the control plane
    spends ~10% less CPU per streamed token on it than on asyncio's own."""
    import uvloop

    async def run() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await main()
        except asyncio.CancelledError:
            pass

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())


def try_curl(url: str, api_key: str | None) -> list[str]:
    """The lines `up` prints to show a first request. The API key itself is never printed (a
    log may keep it): the header reads it from $PAGEDSERVE_API_KEY, where the gateway reads it
    too; a key given by --api-key comes with a line saying to export it."""
    message = '{"role": "user", "content": "What is the capital of France?"}'
    curl = f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'"
    if api_key:
        curl += ' -H "Authorization: Bearer $PAGEDSERVE_API_KEY"'
    lines = [f"""{curl} -d '{{"messages": [{message}], "temperature": 0}}'"""]
    if api_key and envs.get().api_key != api_key:
        lines.insert(0, "export PAGEDSERVE_API_KEY=<the key given by --api-key>, then")
    return lines


def run_cluster(a: argparse.Namespace, model_dir: str) -> int:
    try:  # each worker's GPUs, or why the flags cannot place them, before anything starts
        worker_envs = devices.from_args(a, os.environ.get(devices.VISIBLE))
    except devices.DeviceError as exc:
        raise StartupError(str(exc)) from None
    # The children's lines are shown on this process's stdout: human-readable on a terminal
    # (in colour), JSON otherwise, unless --log-format says which.
    tty = sys.stdout.isatty()
    env = {**os.environ, "PAGEDSERVE_LOG_FORMAT": resolve_format(a.log_format, tty)}
    if tty and env["PAGEDSERVE_LOG_FORMAT"] == "console":
        env["FORCE_COLOR"] = "1"
    # One gRPC token for the cluster, the given one or a fresh one, so that the local ports
    # refuse whoever else can reach them; children get it by the environment (argv shows in
    # `ps`), and `pagedserve generate` / `stats` find it where save_token leaves it.
    env["PAGEDSERVE_GRPC_TOKEN"] = a.grpc_token or secrets.token_urlsafe(32)
    token_file = grpc_security.save_token(f"{a.host}:{a.grpc_port}", env["PAGEDSERVE_GRPC_TOKEN"])
    py = [sys.executable, "-m", "pagedserve.cli"]
    children: list[Child] = []
    restartable: list[Child] = []

    stop_on_signals()
    try:
        redis_url = a.redis_url
        if redis_url is None:
            redis, redis_url = _start_redis(a, env)
            if redis is not None:
                children.append(redis)
                restartable.append(redis)
        addresses = []
        workers = []
        kv_share = cpu_kv_share(a.workers, a.device, a.kv_cache_memory)
        for i, extra in enumerate(worker_envs):
            port = a.worker_base_port + i
            addresses.append(f"{a.host}:{port}")
            argv = ["worker", "--model", model_dir, "--host", a.host, "--port", str(port)]
            if kv_share is not None:
                argv += ["--kv-cache-memory", str(kv_share)]
            argv = py + argv + _passthrough(a, WORKER_FLAGS)
            workers.append(Child(f"worker-{i}", argv, {**env, **extra}, WHILE_DOWN["worker"]))
            if extra:
                print(f"worker-{i}: {' '.join(f'{k}={v}' for k, v in extra.items())}", flush=True)
        children += workers
        restartable += workers
        for child, address in zip(workers, addresses, strict=True):
            wait_serving(address, child)
        cp_address = f"{a.host}:{a.grpc_port}"
        cp_argv = ["control-plane", "--host", a.host, "--port", str(a.grpc_port)]
        cp_argv += ["--workers", ",".join(addresses)]
        if redis_url:
            cp_argv += ["--redis-url", redis_url]
        cp_argv = py + cp_argv + _passthrough(a, SCHEDULER_FLAGS + BUDGET_FLAGS)
        cp = Child("control-plane", cp_argv, env, WHILE_DOWN["control-plane"])
        children.append(cp)
        restartable.append(cp)
        wait_serving(cp_address, cp)
        http_port = a.port  # decided, as every port, before anything started (ports.up_ports)
        url = f"http://{a.host}:{http_port}"
        gw_argv = ["gateway", "--host", a.host, "--port", str(http_port)]
        gw_argv += ["--control-plane", cp_address]
        gw_env = dict(env)
        if a.api_key:  # through the environment, not argv, which `ps` shows to everyone
            gw_env["PAGEDSERVE_API_KEY"] = a.api_key
        gateway = Child(
            "gateway", py + gw_argv + _passthrough(a, GATEWAY_FLAGS + BUDGET_FLAGS), gw_env
        )
        children.append(gateway)
        wait_until(lambda: http_ok(f"{url}/health"), gateway, f"{url}/health")
        print(
            f"pagedserve is up: {url} (OpenAI API), control plane at {cp_address} (gRPC), "
            f"model {model_dir}",
            flush=True,
        )
        print("\n".join(try_curl(url, a.api_key)), flush=True)
        print(grpc_security.saved_token_line(token_file), flush=True)
        # Workers, Redis and the control plane are restarted when they exit, each on its own
        # address: the control plane moves a worker's requests and takes it back when it
        # answers, rebuilds the prefix index once Redis answers, and a restarted control plane
        # registers the workers again, whose Execute streams then belong to it; the gateway's
        # channel reconnects to it. The gateway exiting stops the cluster.
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            for child in restartable:
                child.supervise(now)
            dead = [c for c in children if c not in restartable and c.proc.poll() is not None]
            if dead:
                exits = ", ".join(f"{c.name} (code {c.proc.returncode})" for c in dead)
                print(f"stopping: {exits} exited", file=sys.stderr)
                return 1
    except KeyboardInterrupt:
        print("stopping (draining in-flight requests)", flush=True)
        return 0
    finally:
        _stop_all(children, a.graceful_shutdown_timeout + 5)


def _stop_all(children: list[Child], gateway_timeout: float) -> None:
    """Reverse start order; a second Ctrl-C kills whatever is still running."""
    try:
        for child in reversed(children):
            child.stop(gateway_timeout if child.name == "gateway" else 15.0)
    except KeyboardInterrupt:
        for child in children:
            if child.proc.poll() is None:
                child.proc.kill()
