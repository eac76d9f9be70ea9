"""--max-request-bytes against a real gateway process: a body past the limit gets its 413 at
once, whether Content-Length announces it or a chunked body grows past it, and the gateway
stops reading and closes the connection instead of draining what the client goes on sending.

The control plane address leads nowhere: the limit is enforced before any route runs.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import httpx
import pytest
import requests

from tests.gateway_stack import HttpProcess, Processes
from tests.procs import free_port

# Wall-clock bounds: run alone (`make test` runs these after the rest).
pytestmark = pytest.mark.serial

LIMIT = 64 << 10
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def gateway() -> Iterator[HttpProcess]:
    procs = Processes()
    try:
        yield procs.gateway(f"127.0.0.1:{free_port()}", "--max-request-bytes", str(LIMIT))
    finally:
        procs.stop_all()


def connect(gw: HttpProcess) -> socket.socket:
    url = urlsplit(gw.url)
    assert url.hostname is not None and url.port is not None
    return socket.create_connection((url.hostname, url.port), timeout=5)


def read_response(sock: socket.socket, timeout: float) -> tuple[bytes, float, bool]:
    """(what arrived, seconds until the status line did, whether the server closed)."""
    start = time.monotonic()
    deadline = start + timeout
    data = b""
    first_at = float("inf")
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            part = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return data, first_at, True
        if not part:
            return data, first_at, True
        data += part
        if b"\r\n" in data and first_at == float("inf"):
            first_at = time.monotonic() - start
    return data, first_at, False


def assert_413(data: bytes) -> None:
    status, _, rest = data.partition(b"\r\n")
    assert status == b"HTTP/1.1 413 Request Entity Too Large", data[:300]
    headers = rest.lower()
    assert b"connection: close" in headers
    assert b"x-request-id:" in headers
    assert b'"code":"request_too_large"' in data


def test_chunked_body_past_the_limit_is_refused_at_once(gateway: HttpProcess) -> None:
    with connect(gateway) as sock:
        part = b'{"prompt": "' + b"x" * (2 * LIMIT)
        sock.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        sock.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        # The rest of the body and its closing chunk never come.
        data, first_at, closed = read_response(sock, timeout=10)
    assert_413(data)
    assert first_at < 2.0
    assert closed, "the connection stays open after the 413"


def test_content_length_past_the_limit_is_refused_before_the_body(gateway: HttpProcess) -> None:
    with connect(gateway) as sock:
        sock.sendall(HEAD + f"Content-Length: {2 * LIMIT}\r\n\r\n".encode())
        # No body at all: the answer may not wait for it.
        data, first_at, closed = read_response(sock, timeout=10)
    assert_413(data)
    assert first_at < 2.0
    assert closed


def test_a_client_that_keeps_sending_is_cut_off(gateway: HttpProcess) -> None:
    """A client streaming a 64 MiB body: the gateway reads at most the limit plus a short
    linger, then closes, so what the client gets to send stays within the socket buffers."""
    sent = 0
    stop = threading.Event()
    with connect(gateway) as sock:
        sock.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b"1000\r\n" + b"x" * 0x1000 + b"\r\n"

        def pump() -> None:
            nonlocal sent
            sock.settimeout(10)
            try:
                while not stop.is_set() and sent < 64 << 20:
                    sock.sendall(piece)
                    sent += len(piece)
            except OSError:
                pass  # closed by the gateway, as wanted

        sender = threading.Thread(target=pump)
        sender.start()
        try:
            data, first_at, closed = read_response(sock, timeout=10)
        finally:
            stop.set()
            sender.join(15)
    assert_413(data)
    assert first_at < 2.0 and closed
    assert sent < 40 << 20, f"{sent} bytes went in before the gateway stopped reading"


def test_plain_http_client_reads_the_413(gateway: HttpProcess) -> None:
    """A client that writes its whole (large) body before reading still gets the 413."""
    r = httpx.post(
        f"{gateway.url}/v1/completions",
        content=b'{"prompt": "' + b"x" * (8 << 20) + b'"}',
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


BIG = b'{"prompt": "' + b"x" * (8 << 20) + b'"}'


def _http_client(url: str) -> tuple[int, bytes]:
    parts = urlsplit(url)
    assert parts.hostname is not None
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", BIG, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _http_client_chunked(url: str) -> tuple[int, bytes]:
    parts = urlsplit(url)
    assert parts.hostname is not None
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    pieces = (BIG[i : i + (64 << 10)] for i in range(0, len(BIG), 64 << 10))
    try:
        conn.request(
            "POST",
            "/v1/completions",
            pieces,
            {"Content-Type": "application/json", "Transfer-Encoding": "chunked"},
            encode_chunked=True,
        )
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _requests(url: str) -> tuple[int, bytes]:
    r = requests.post(
        f"{url}/v1/completions",
        data=BIG,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    return r.status_code, r.content


@pytest.mark.parametrize(
    "post", [_http_client, _http_client_chunked, _requests], ids=lambda f: f.__name__.strip("_")
)
def test_clients_that_write_the_whole_body_first_read_the_413(
    gateway: HttpProcess, post: Callable[[str], tuple[int, bytes]]
) -> None:
    """http.client and requests read nothing until their 8 MiB body is written: the gateway
    reads and drops the rest after its 413 (bounded), so they find it rather than a
    ConnectionResetError."""
    status, data = post(gateway.url)
    assert status == 413
    assert b'"code":"request_too_large"' in data


def test_body_at_the_limit_passes(gateway: HttpProcess) -> None:
    body = b'{"prompt": "' + b"x" * (LIMIT - 14) + b'"}'
    assert len(body) == LIMIT
    r = httpx.post(
        f"{gateway.url}/v1/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 503  # past the limit check: no control plane to answer
    over = httpx.post(
        f"{gateway.url}/v1/completions",
        content=body + b" ",
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert over.status_code == 413
