"""`pagedserve up` keeps serving when a part dies: a worker (the control plane moves its
requests), redis-server (placement by load, then the index rebuilt) or the control plane (its
requests fail, new ones are served once it is back) is started again (logged); the cluster
stops only on its own signal or when the gateway exits."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import STARTUP_S, drain, free_port, read_until

# A whole cluster's start: its workers start side by side, each as slow as a busy machine makes it.
UP_S = 2 * STARTUP_S


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
@pytest.mark.timeout(UP_S + 3 * STARTUP_S)
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
        lines += read_until(proc, "pagedserve is up", UP_S)
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
            assert time.monotonic() - start < STARTUP_S, "".join(lines)[-3000:]
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


def _pid_of(*words: bytes) -> int:
    """The pid of the one process whose argv holds every word."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(int(p), *words)]
    assert len(pids) == 1, (words, pids)
    return pids[0]


def _post(url: str, body: dict[str, object]) -> httpx.Response | None:
    try:
        return httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    except httpx.HTTPError:
        return None


def _served_within(url: str, body: dict[str, object], bound: float, lines: list[str]) -> float:
    """Seconds until a request is answered 200, asking again until `bound`."""
    start = time.monotonic()
    while True:
        r = _post(url, body)
        if r is not None and r.status_code == 200:
            return time.monotonic() - start
        elapsed = time.monotonic() - start
        assert elapsed < bound, f"no 200 in {bound} s: {r and r.text}\n{''.join(lines)[-4000:]}"
        time.sleep(0.2)


WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


@pytest.mark.serial  # bounded by the wall clock: served again within seconds of each death
@pytest.mark.timeout(UP_S + 3 * STARTUP_S)
def test_up_restarts_redis_and_the_control_plane_and_keeps_serving(micro_llama: Path) -> None:
    """Redis dying leaves serving on (placement by load) and, once `up` has restarted it, the
    index is rebuilt with what was cached before; the control plane dying fails its in-flight
    requests with an error, and once `up` has restarted it the workers register with it and
    the gateway serves again. `up` runs on throughout."""
    import redis

    http_port, grpc_port, base, redis_port = (free_port() for _ in range(4))
    argv = [
        sys.executable, "-m", "pagedserve.cli", "up", "--model", str(micro_llama),
        "--port", str(http_port), "--grpc-port", str(grpc_port),
        "--worker-base-port", str(base), "--redis-port", str(redis_port),
        "--kv-cache-memory", "32MiB",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    url = f"http://127.0.0.1:{http_port}"
    index = redis.Redis(port=redis_port, socket_timeout=2)
    plain = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    try:
        lines += read_until(proc, "pagedserve is up", UP_S)
        assert any("pagedserve is up" in x for x in lines), "".join(lines)[-3000:]
        drain(proc, lines)

        # Blocks cached by a prompt of several blocks reach the index.
        long_a = {**plain, "prompt": " ".join(WORDS * 4)}
        assert (r := _post(url, long_a)) is not None and r.status_code == 200
        deadline = time.monotonic() + 120
        while not (cached := set(index.keys("pagedserve:*:b:*"))):
            assert time.monotonic() < deadline, "nothing reached the prefix index"
            time.sleep(0.2)

        # Redis dies: requests are served on, and `up` starts it again, empty.
        os.kill(int(index.info("server")["process_id"]), signal.SIGKILL)
        redis_down = _served_within(url, plain, 120, lines)
        deadline = time.monotonic() + 120
        while "redis restarted" not in "".join(lines):
            assert time.monotonic() < deadline, "".join(lines)[-3000:]
            assert proc.poll() is None, "".join(lines)[-3000:]
            time.sleep(0.2)
        assert "redis exited with code -9: restarting it in 1 s" in "".join(lines)
        # The control plane notices, with no request to make it, and rebuilds the index: what
        # it held before is back.
        deadline = time.monotonic() + 120
        while True:
            try:
                if cached <= set(index.keys("pagedserve:*:b:*")):
                    break
            except redis.RedisError:
                pass
            assert time.monotonic() < deadline, "the index was not rebuilt"
            time.sleep(0.5)
        assert "prefix_index_rebuilt" in "".join(lines)

        # The control plane dies with a stream in flight: the stream ends with an error.
        events: list[str] = []
        streaming = {**plain, "max_tokens": 2000, "ignore_eos": True, "stream": True}

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=streaming, timeout=60) as s:
                for line in s.iter_lines():
                    events.append(line)

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        while not any(e.startswith("data: {") for e in events):
            assert time.monotonic() < deadline and reader.is_alive(), events
            time.sleep(0.05)
        os.kill(_pid_of(b"control-plane", b"--port", str(grpc_port).encode()), signal.SIGKILL)
        reader.join(120)  # its read timeout is 60 s: a hang ends without an error event
        assert not reader.is_alive(), "the stream hung after the control plane died"
        assert any('"error"' in e for e in events), events[-5:]
        assert [e for e in events if e][-1] == "data: [DONE]"

        cp_down = _served_within(url, plain, STARTUP_S, lines)
        log = "".join(lines)
        assert "control-plane exited with code -9: restarting it in 1 s" in log
        assert "control-plane restarted" in log
        assert proc.poll() is None, log[-3000:]
        print(f"served {redis_down:.1f} s after redis died, {cp_down:.1f} s after the cp died")

        # Killing it again is one more restart, after a longer wait (the restart budget).
        os.kill(_pid_of(b"control-plane", b"--port", str(grpc_port).encode()), signal.SIGKILL)
        _served_within(url, plain, STARTUP_S, lines)
        assert "control-plane exited with code -9: restarting it in 2 s" in "".join(lines)
        assert proc.poll() is None
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
