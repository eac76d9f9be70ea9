"""The gateway when the control plane stops, dies and comes back, and at its HTTP edge against
slow or too many clients and requests past the gRPC message limit. Real worker, control plane
(with a gRPC token) and gateway processes; the control plane is stopped (SIGSTOP) and killed
and restarted on its port, so the tests run in this order."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve import grpc_security
from tests.gateway_stack import HttpProcess, Processes
from tests.procs import STARTUP_S, ServerProcess, free_port
from tests.stack import Stack, start_stack

# Wall-clock bounds: run alone (`make test` runs these after the rest).
pytestmark = pytest.mark.serial

# What the tests wait for at most before they call it a hang: the bounds on what must be quick
# are fractions of it, well above what a busy machine adds and below the hangs they rule out.
HANG_S = 30.0
# How long a connection the gateway must close is given: past the 1 s deadlines the tests set
# (a busy machine adds seconds), short of the 10 s default header deadline.
CLOSE_WAIT_S = 8.0
TOKEN = "resilience-token"
ENV = {"PAGEDSERVE_GRPC_TOKEN": TOKEN}


@pytest.fixture(scope="module")
def stack(module_spawn: Callable[..., ServerProcess], micro_llama: Path) -> Stack:
    return start_stack(module_spawn, micro_llama, token=TOKEN)


@pytest.fixture
def procs() -> Iterator[Processes]:
    p = Processes()
    yield p
    p.stop_all()


def _raw(port: int, data: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    if data:
        s.sendall(data)
    return s


def _closed_within(s: socket.socket, timeout: float) -> bytes | None:
    """What the server sent before closing, or None if it is still open after timeout."""
    s.settimeout(timeout)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return got


def _port(gw: HttpProcess) -> int:
    return int(gw.url.rsplit(":", 1)[1])


# -- 6: past the 16 MiB gRPC limit ------------------------------------------------------------


def test_request_past_the_grpc_message_limit_is_413_not_429(stack: Stack, procs: Processes) -> None:
    gw = procs.gateway(stack.address, "--max-request-bytes", "24MiB", env=ENV)
    body = {"prompt": "a" * (17 << 20), "max_tokens": 1}
    r = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 413, r.text
    assert "retry-after" not in r.headers  # no retrying a request that can never be served
    assert r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(f"{gw.url}/tokenize", json={"prompt": body["prompt"]}, timeout=60)
    assert r.status_code == 413, r.text


# -- 5: the HTTP edge -------------------------------------------------------------------------


def test_slow_headers_and_bodies_time_out(procs: Processes) -> None:
    nowhere = f"127.0.0.1:{free_port()}"  # reading requests needs no control plane
    gw = procs.gateway(nowhere, "--http-header-timeout", "1", "--http-body-timeout", "1")
    port = _port(gw)
    start = time.monotonic()
    silent = [_raw(port) for _ in range(20)]
    partial = [_raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(20)]
    # A slowloris client sends a header byte now and then: that must not push the deadline.
    for _ in range(4):
        time.sleep(0.3)
        for s in partial:
            try:
                s.sendall(b"X")
            except OSError:
                pass
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    slow_body = _raw(port, head + b'{"prompt":')
    body_sent = time.monotonic()
    for s in silent:
        assert _closed_within(s, CLOSE_WAIT_S) == b""
    for s in partial:
        got = _closed_within(s, CLOSE_WAIT_S)
        assert got is not None and got.startswith(b"HTTP/1.1 408"), got
    assert time.monotonic() - start < CLOSE_WAIT_S
    got = _closed_within(slow_body, CLOSE_WAIT_S)
    assert got is not None and got.startswith(b"HTTP/1.1 408"), got
    assert b"--http-body-timeout" in got
    assert time.monotonic() - body_sent < CLOSE_WAIT_S
    r = httpx.get(f"{gw.url}/version", timeout=HANG_S)  # a prompt client is still served
    assert r.status_code == 200


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\n{}\r\n0\r\n\r\n",
        b"GET /version HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",
    ],
    ids=["content-length not a number", "length and chunked", "bad chunk size", "bad header"],
)
def test_unparsable_http_gets_a_400_in_openais_shape(procs: Processes, head: bytes) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    gw = procs.gateway(nowhere)
    got = _closed_within(_raw(_port(gw), head), CLOSE_WAIT_S)
    assert got is not None and got.startswith(b"HTTP/1.1 400"), got
    assert b"content-type: application/json" in got.lower()
    error = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_http_request"
    r = httpx.get(f"{gw.url}/version", timeout=HANG_S)  # the gateway serves on
    assert r.status_code == 200


def test_a_head_past_the_cap_gets_431_and_kept_alive_requests_are_still_timed(
    procs: Processes,
) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    gw = procs.gateway(nowhere, "--http-header-timeout", "1", "--http-body-timeout", "1")
    port = _port(gw)
    # Headers sent fast enough to beat the deadline, but without end.
    big = _raw(port, b"GET /version HTTP/1.1\r\nHost: x\r\n")
    try:
        for _ in range(100):
            big.sendall(b"X-Filler: " + b"y" * 1000 + b"\r\n")
    except OSError:
        pass  # refused and closed before the client was done
    got = _closed_within(big, CLOSE_WAIT_S)
    assert got is not None and got.startswith(b"HTTP/1.1 431"), got
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == (
        "request_header_fields_too_large"
    )
    # A kept-alive connection: each request's head has the same deadline after a response, and
    # two requests sent together (pipelined) are both answered.
    s = _raw(port, b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
    s.settimeout(3)
    answered = b""
    while answered.count(b'{"version"') < 2:  # both responses, to their bodies' ends
        answered += s.recv(65536)
    s.sendall(b"GET /version HTTP/1.1\r\n")  # then nothing more
    got = _closed_within(s, CLOSE_WAIT_S)
    assert got is not None and got.startswith(b"HTTP/1.1 408"), got
    # A request pipelined behind another, its body cut short: once the first is answered, the
    # second's body is owed under its deadline.
    s = _raw(
        port,
        b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n"
        b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt":',
    )
    got = _closed_within(s, CLOSE_WAIT_S)
    assert got is not None and got.startswith(b"HTTP/1.1 200"), got
    assert b"HTTP/1.1 408" in got and b"--http-body-timeout" in got, got
    assert httpx.get(f"{gw.url}/version", timeout=HANG_S).status_code == 200


def test_one_header_past_the_cap_gets_431(procs: Processes) -> None:
    """A head past the cap that arrives in one piece (one 70 KB header) is refused too, not
    only one that trickles in."""
    nowhere = f"127.0.0.1:{free_port()}"
    gw = procs.gateway(nowhere)
    for head in (
        b"GET /version HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n",
        b"GET /version?" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n",
        b"GET /version HTTP/1.1\r\nHost: x\r\n" + (b"X-Many: " + b"b" * 1000 + b"\r\n") * 70,
    ):
        got = _closed_within(_raw(_port(gw), head + b"\r\n"), CLOSE_WAIT_S)
        assert got is not None and got.startswith(b"HTTP/1.1 431"), got
        error = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "request_header_fields_too_large"
    # Just under the cap: served.
    r = httpx.get(f"{gw.url}/version", headers={"X-Big": "a" * 60_000}, timeout=HANG_S)
    assert r.status_code == 200


def test_docs_need_the_api_key(procs: Processes) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    gw = procs.gateway(nowhere, "--api-key", "docs-key")
    for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
        r = httpx.get(f"{gw.url}{path}", timeout=HANG_S)
        assert r.status_code == 401, (path, r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.get(
            f"{gw.url}{path}", headers={"Authorization": "Bearer docs-key"}, timeout=HANG_S
        )
        assert r.status_code == 200, (path, r.status_code)
    # Probes stay open.
    assert httpx.get(f"{gw.url}/version", timeout=HANG_S).status_code == 200
    assert httpx.get(f"{gw.url}/metrics", timeout=HANG_S).status_code == 200
    assert httpx.get(f"{gw.url}/health", timeout=HANG_S).status_code == 503  # no control plane


def test_connections_past_the_cap_get_503(procs: Processes) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    gw = procs.gateway(nowhere, "--max-connections", "4", "--http-header-timeout", "30")
    port = _port(gw)
    with httpx.Client(timeout=HANG_S) as client:  # one kept-alive connection, open first
        assert client.get(f"{gw.url}/version").status_code == 200
        idle = [_raw(port) for _ in range(3)]
        time.sleep(0.2)
        r = httpx.get(f"{gw.url}/version", timeout=HANG_S)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert "--max-connections" in r.json()["error"]["message"]
        assert client.get(f"{gw.url}/version").status_code == 200  # open before: served
        for s in idle:
            s.close()
        time.sleep(0.2)
        assert httpx.get(f"{gw.url}/version", timeout=HANG_S).status_code == 200


def test_body_past_the_limit_gets_413_before_it_ends(procs: Processes) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    gw = procs.gateway(nowhere, "--max-request-bytes", "1MiB")
    s = _raw(
        _port(gw),
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
    )
    chunk = b"x" * (256 << 10)
    for _ in range(5):  # 1.25 MiB of a body that never ends
        s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    got = _closed_within(s, CLOSE_WAIT_S)
    assert got is not None and got.startswith(b"HTTP/1.1 413"), got


# -- 4: a stopped control plane ---------------------------------------------------------------


def _data_events(lines: Iterator[str]) -> Iterator[dict[str, object] | str]:
    for line in lines:
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            yield payload if payload == "[DONE]" else json.loads(payload)


def test_stopped_control_plane_fails_requests_in_seconds(stack: Stack, procs: Processes) -> None:
    gw = procs.gateway(stack.address, env=ENV)
    pid = stack.control_plane.proc.pid
    body = {"prompt": "hello", "max_tokens": 1800, "ignore_eos": True, "stream": True}
    stopped = 0.0
    try:
        with httpx.Client(timeout=HANG_S) as client:
            with client.stream("POST", f"{gw.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                events = _data_events(r.iter_lines())
                first = next(events)
                assert isinstance(first, dict) and "choices" in first
                os.kill(pid, signal.SIGSTOP)
                stopped = time.monotonic()
                rest = list(events)  # before: a read timeout (the stream hung ~60 s)
                ended = time.monotonic() - stopped
        errors = [e for e in rest if isinstance(e, dict) and "error" in e]
        assert errors and rest[-1] == "[DONE]", rest[-3:]
        # A keepalive ping unanswered (5 s on a quiet machine), not the hang.
        assert ended < HANG_S / 3, ended
        # Noticed: a new request is refused without waiting for the control plane (it waits
        # its 0.5 s for the channel at most), with Retry-After.
        t = time.monotonic()
        r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "hi"}, timeout=HANG_S)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert time.monotonic() - t < HANG_S / 6
        t = time.monotonic()
        assert httpx.get(f"{gw.url}/health", timeout=HANG_S).status_code == 503
        assert time.monotonic() - t < HANG_S / 6
    finally:
        os.kill(pid, signal.SIGCONT)


# -- 3: a restarted control plane -------------------------------------------------------------


def _serving(address: str) -> bool:
    """One health check over a new channel, so that no back-off of ours delays the answer."""
    with grpc_security.channel(address, grpc_security.INSECURE) as channel:
        try:
            r = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=1
            )
        except grpc.RpcError:
            return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


def test_gateway_reconnects_within_seconds_of_a_restarted_control_plane(
    stack: Stack, procs: Processes
) -> None:
    gw = procs.gateway(stack.address, env=ENV)
    old = stack.control_plane
    deadline = time.monotonic() + 30  # after the previous test, the control plane may lag
    while httpx.get(f"{gw.url}/health", timeout=HANG_S).status_code != 200:
        assert time.monotonic() < deadline, "the gateway never became healthy"
        time.sleep(0.2)
    old.proc.kill()
    old.proc.wait()
    killed = time.monotonic()
    # Clients keep asking during the outage: with gRPC's default back-off every failure
    # pushed the next connection attempt further out (10.8 s late after a 17 s outage).
    while time.monotonic() - killed < 9:
        t = time.monotonic()
        assert httpx.get(f"{gw.url}/health", timeout=HANG_S).status_code == 503
        r = httpx.post(f"{gw.url}/v1/completions", json={"prompt": "hi"}, timeout=HANG_S)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert time.monotonic() - t < HANG_S / 6
        time.sleep(0.25)
    new = ServerProcess("control-plane", list(old.proc.args)[3:], stack.address, env=ENV)
    try:
        while not _serving(stack.address):
            assert new.proc.poll() is None, new.output()[-2000:]
            assert time.monotonic() - killed < STARTUP_S, "the control plane did not come back"
            time.sleep(0.05)
        back = time.monotonic()
        while httpx.get(f"{gw.url}/health", timeout=HANG_S).status_code != 200:
            assert time.monotonic() - back < HANG_S, "the gateway did not reconnect"
            time.sleep(0.05)
        reconnect_s = time.monotonic() - back
        r = httpx.post(
            f"{gw.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=HANG_S
        )
        assert r.status_code == 200, r.text
        # Within the back-off's 1 s cap and a few health checks (benchmarks/gateway_reconnect.py
        # measures it); gRPC's default back-off was 10.8 s late after a 17 s outage.
        assert reconnect_s < 5.0, reconnect_s
    finally:
        new.stop()
