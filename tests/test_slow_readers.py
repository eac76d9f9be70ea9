"""Clients that never read: the gateway holds a bounded buffer for them, the control plane's
writes wait under gRPC flow control, and after the stall timeout their requests are aborted and
their KV blocks freed, and their connections closed, answer finished or not; memory stays
bounded. Real worker, control plane, gateway; a scripted control plane for answers of a
chosen size."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.gateway_stack import Processes, gateway_process
from tests.paced_control_plane import PacedServer
from tests.procs import ServerProcess
from tests.stack import start_stack

# Wall-clock bounds: run alone (`make test` runs these after the rest).
pytestmark = pytest.mark.serial

STALL_S = 1


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def never_reading_stream(port: int, body: dict[str, object], rid: str = "") -> socket.socket:
    """A streamed completion request on a socket that is never read (a small receive buffer,
    so the server's writes back up at once), with x-request-id `rid` where given."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    header = f"x-request-id: {rid}\r\n" if rid else ""
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"{header}Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


@pytest.mark.timeout(180)
def test_never_reading_clients_are_bounded_then_aborted(
    spawn: Callable[..., ServerProcess], micro_llama: Path
) -> None:
    stack = start_stack(spawn, micro_llama, num_gpu_blocks=512)
    gw = gateway_process(stack.address, "--stream-stall-timeout", str(STALL_S))
    port = int(gw.url.rsplit(":", 1)[1])
    try:
        total_blocks = stack.stats().workers[0].num_free_gpu_blocks
        # A request that reads: the gateway's shared upstream call opens with it.
        opener = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 2},
            headers={"x-request-id": "opener"},
            timeout=30,
        )
        assert opener.status_code == 200, opener.text
        before = rss_mib(gw.proc.pid)
        body = {
            "prompt": [5, 6, 7], "max_tokens": 2000, "n": 8, "logprobs": 5, "stream": True,
            "ignore_eos": True, "temperature": 1.0, "seed": 1,
        }  # fmt: skip
        clients = [never_reading_stream(port, body, f"stalled-{i}") for i in range(2)]
        peak = before
        start = time.monotonic()
        while time.monotonic() - start < STALL_S + 20:
            peak = max(peak, rss_mib(gw.proc.pid))
            s = stack.stats()
            if s.num_requests_aborted >= 2 and s.num_running == 0:
                break
            time.sleep(0.2)
        s = stack.stats()
        # Both requests aborted after the stall, long before their 2,000 tokens x 8.
        assert s.num_requests_aborted >= 2 and s.num_running == 0, s
        assert s.workers[0].num_generated_tokens < 2 * 8 * 2000
        assert s.workers[0].num_free_gpu_blocks == total_blocks
        events = [json.loads(line) for line in gw.output().splitlines() if line.startswith("{")]
        # Noticed by the connection (the client took no bytes) or by the request (it took no
        # messages), whichever comes first; each names the stalled request, not the one that
        # opened the shared call.
        stalls = [e for e in events if e["event"] in ("http_write_stalled", "stream_stalled")]
        assert sorted({e["request_id"] for e in stalls}) == ["stalled-0", "stalled-1"], stalls
        assert peak - before < 40, f"gateway grew {peak - before:.0f} MiB"
        for c in clients:
            c.close()
        time.sleep(1)
        assert rss_mib(gw.proc.pid) - before < 40
        # The gateway serves on.
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 4},
            timeout=30,
        )
        assert r.status_code == 200, r.text
    finally:
        gw.stop()


def read_until_closed(s: socket.socket, timeout: float) -> tuple[int, bool]:
    """(bytes read, whether the server closed the connection) within `timeout`."""
    s.settimeout(timeout)
    total = 0
    try:
        while chunk := s.recv(1 << 16):
            total += len(chunk)
    except ConnectionResetError:
        pass
    except TimeoutError:
        return total, False
    return total, True


@pytest.mark.timeout(120)
def test_a_finished_answer_is_not_held_for_a_client_that_never_reads() -> None:
    """The answer is all there (generation ended): 8 MiB wait in the gateway for a client that
    reads none of them. After the stall timeout the connection is cut and they are dropped;
    before, the socket and its bytes were held for as long as the client kept it open."""
    size = 8 << 20
    server = PacedServer()
    procs = Processes()
    try:
        gw = procs.gateway(
            server.address, "--served-model-name", "m", "--stream-stall-timeout", str(STALL_S)
        )
        port = int(gw.url.rsplit(":", 1)[1])
        for stream in (True, False):
            body = {"prompt": f"big:{size}", "max_tokens": 1, "stream": stream}
            client = never_reading_stream(port, body)
            time.sleep(STALL_S + 4)
            # Reading now: a connection still open would hand over the whole answer.
            got, closed = read_until_closed(client, timeout=3)
            client.close()
            assert closed and got < size, (stream, got, closed)
        r = httpx.post(
            f"{gw.url}/v1/completions", json={"prompt": "ok", "max_tokens": 1}, timeout=30
        )
        assert r.status_code == 200, r.text
    finally:
        procs.stop_all()
        server.stop()
