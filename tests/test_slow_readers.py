"""Streaming clients that never read: the gateway holds a bounded buffer for them, the control
plane's writes wait under gRPC flow control, and after the stall timeout their requests are
aborted and their KV blocks freed; memory stays bounded. Real worker, control plane, gateway."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.gateway_stack import gateway_process
from tests.procs import ServerProcess
from tests.stack import start_stack

STALL_S = 1
# How long the stalled requests may take to be aborted: a stall starts only once the
# gateway's socket and transport buffers are full (a few MB), at whatever pace the machine
# generates tokens. This bounds a hang; the order of events is what is checked.
ABORT_WAIT_S = 240
# The two stall checks, either of which may cut a stalled stream off first: the response's
# (messages waiting untaken, gateway.upstream.Inbox) and the connection's (bytes unsent,
# gateway.connections).
STALL_EVENTS = ("stream_stalled", "http_write_stalled")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def never_reading_stream(port: int, path: str, body: dict[str, object], rid: str) -> socket.socket:
    """A streamed request to `path` on a socket that is never read (a small receive buffer, so
    the server's writes back up at once), with x-request-id `rid`."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
        + f"x-request-id: {rid}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


@pytest.mark.timeout(ABORT_WAIT_S + 180)
def test_never_reading_clients_are_bounded_then_aborted(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    stack = start_stack(spawn, micro_llama, num_gpu_blocks=2048)
    gw = gateway_process(stack.address, "--stream-stall-timeout", str(STALL_S))
    port = int(gw.url.rsplit(":", 1)[1])
    try:
        total_blocks = stack.stats().workers[0].num_free_gpu_blocks
        # A request that reads: the gateway's shared upstream call opens with it.
        opener = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 2},
            headers={"x-request-id": "opener"},
            timeout=60,
        )
        assert opener.status_code == 200, opener.text
        before = rss_mib(gw.proc.pid)
        # The most bytes a step can make (16 completions, 20 alternatives to each token with
        # their bytes), so that few steps fill the buffers on a slow machine too.
        body = {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000, "n": 16,
            "logprobs": True, "top_logprobs": 20, "stream": True, "ignore_eos": True,
            "temperature": 1.0, "seed": 1,
        }  # fmt: skip
        path = "/v1/chat/completions"
        clients = [never_reading_stream(port, path, body, f"stalled-{i}") for i in range(2)]
        peak = before
        deadline = time.monotonic() + ABORT_WAIT_S
        while time.monotonic() < deadline:
            peak = max(peak, rss_mib(gw.proc.pid))
            s = stack.stats()
            if s.num_requests_aborted >= 2 and s.num_running == 0:
                break
            time.sleep(0.2)
        s = stack.stats()
        # Both requests aborted after the stall, long before their 2,000 tokens x 16.
        assert s.num_requests_aborted >= 2 and s.num_running == 0, s
        assert s.workers[0].num_generated_tokens < 2 * 16 * 2000
        assert s.workers[0].num_free_gpu_blocks == total_blocks
        stalls = [
            json.loads(line)
            for line in gw.output().splitlines()
            if line.startswith("{") and any(f'"{e}"' in line for e in STALL_EVENTS)
        ]
        # Each stalled request is named, never the one that opened the shared call.
        assert {e["request_id"] for e in stalls} == {"stalled-0", "stalled-1"}, stalls
        assert peak - before < 40, f"gateway grew {peak - before:.0f} MiB"
        for c in clients:
            c.close()
        time.sleep(1)
        assert rss_mib(gw.proc.pid) - before < 40
        # The gateway serves on.
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200, r.text
    finally:
        gw.stop()
