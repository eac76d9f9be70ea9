"""`pagedserve up --workers 2` keeps serving when a worker dies: the control plane moves its
requests, `up` starts it again (logged), and the cluster stops only on its own signal or when a
part it cannot restart exits."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import drain, free_port, read_until


def pid_listening_as_worker(port: int) -> int:
    """The pid of the `pagedserve worker` process started with --port port."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if (
            b"worker" in argv
            and b"--port" in argv
            and argv[argv.index(b"--port") + 1] == str(port).encode()
        ):
            return int(entry)
    raise AssertionError(f"no worker process with --port {port}")


def _worker_pid(port: int) -> int | None:
    """As pid_listening_as_worker, None while no such process runs (it is being restarted)."""
    try:
        return pid_listening_as_worker(port)
    except AssertionError:
        return None


def healthy_workers(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    m = re.search(r"^pagedserve:num_healthy_workers(?:\{.*\})? (\S+)$", text, re.M)
    return int(float(m[1])) if m else -1


@pytest.mark.serial  # a killed worker's requests must be served again within bounds
def test_up_restarts_a_worker_that_dies_and_keeps_serving(micro_llama: Path) -> None:
    http_port, grpc_port, base = free_port(), free_port(), free_port()
    while base + 1 in (http_port, grpc_port):
        base = free_port()
    argv = [
        sys.executable, "-m", "pagedserve.cli", "up", "--model", str(micro_llama),
        "--workers", "2", "--port", str(http_port), "--grpc-port", str(grpc_port),
        "--worker-base-port", str(base), "--kv-cache-memory", "32MiB",
        "--worker-failover-timeout", "2",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    assert proc.stdout is not None
    url = f"http://127.0.0.1:{http_port}"
    try:
        lines += read_until(proc, "pagedserve is up", 180)
        assert any("pagedserve is up" in x for x in lines), "".join(lines)[-3000:]
        drain(proc, lines)
        assert healthy_workers(url) == 2

        victim = pid_listening_as_worker(base)
        os.kill(victim, signal.SIGKILL)
        body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        # Served meanwhile, by the other worker.
        for _ in range(5):
            try:
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            except httpx.HTTPError as exc:
                log = "".join(lines)[-6000:]
                pytest.fail(f"{exc!r} after the kill; the cluster's log:\n{log}")
            assert r.status_code == 200, r.text
        start = time.monotonic()
        while healthy_workers(url) != 2 or _worker_pid(base) in (None, victim):
            assert time.monotonic() - start < 90, "".join(lines)[-3000:]
            assert proc.poll() is None, "".join(lines)[-3000:]
            time.sleep(0.5)
        log = "".join(lines)
        assert "worker-0 exited with code" in log and "restarting it in" in log
        assert "worker-0 restarted" in log
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text

        # A part that cannot be restarted stops the whole cluster.
        gateway = [
            int(p)
            for p in os.listdir("/proc")
            if p.isdigit() and _cmdline_has(int(p), b"gateway", str(http_port).encode())
        ]
        assert len(gateway) == 1
        os.kill(gateway[0], signal.SIGKILL)
        assert proc.wait(60) == 1
        assert "stopping: gateway (code -9) exited" in "".join(lines)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _cmdline_has(pid: int, *words: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return all(w in argv for w in words)
