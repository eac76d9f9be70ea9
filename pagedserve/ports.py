"""Ports a server is about to listen on, checked before anything starts.

A busy port is then one line that names the flag setting it, rather than a bind traceback from
a process that has already loaded a model. gRPC servers bind with SO_REUSEPORT, so a second
worker on a worker's port would even start and share its connections: the check here binds
without it and so sees any listener. `pagedserve up` checks all of its ports at once; a port
left at its default that is taken is replaced by a free one, and says so.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
from dataclasses import dataclass

DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 50051
DEFAULT_WORKER_BASE_PORT = 50061
_SEARCH_TRIES = 64


class PortError(Exception):
    """A port that was asked for cannot be listened on; the message names its flag."""


def bind_error(host: str, port: int) -> str | None:
    """Why (host, port) cannot be listened on, or None when it can.

    SO_REUSEADDR lets the test bind over connections in TIME_WAIT (a server restarted on its
    own port), as the servers' sockets do; a listener on the port still fails it."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        return f"host {host}: {exc.strerror}"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "is in use"
            if exc.errno == errno.EACCES:
                return "needs privileges to listen on"
            return f"cannot be listened on at {host} ({exc.strerror})"
    return None


def check_port(host: str, port: int, flag: str) -> None:
    """Raises PortError naming `flag` when (host, port) cannot be listened on."""
    if not 0 < port < 65536:
        raise PortError(f"port {port} is not a port (1..65535); choose another with {flag}")
    why = bind_error(host, port)
    if why is not None:
        raise PortError(f"port {port} {why}; choose another with {flag}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class PortRequest:
    """`count` consecutive ports from `given`; when the user gave none, from `default` if
    those are free, else any free run of `count` ports (`default` None: any, quietly)."""

    what: str  # "the gateway", for "port 8000 is taken: the gateway uses 41234"
    flag: str
    given: int | None
    default: int | None
    count: int = 1


def choose_ports(host: str, requests: list[PortRequest]) -> tuple[list[int], list[str]]:
    """The first port of each request, and a note for each default that was replaced.

    Raises PortError when a given port is busy or two requests overlap."""
    first: dict[int, int] = {}
    notes: list[str] = []
    taken: dict[int, str] = {}  # port -> the flag it belongs to
    # Given ports first: the defaults and free picks keep out of their way.
    for i in sorted(range(len(requests)), key=lambda i: requests[i].given is None):
        req = requests[i]
        start = req.given if req.given is not None else req.default
        if start is not None:
            span = range(start, start + req.count)
            clash = next((taken[p] for p in span if p in taken), None)
            if req.given is not None:
                if clash is not None:
                    raise PortError(f"{req.flag} {req.given} overlaps the ports of {clash}")
                for port in span:
                    check_port(host, port, req.flag)
            elif clash is not None or any(bind_error(host, p) is not None for p in span):
                start = None
        if start is None:
            start = _free_run(host, req.count, set(taken))
            if req.default is not None:
                d = req.default
                shown = f"{d}" if req.count == 1 else f"{d}-{d + req.count - 1}"
                uses = "uses" if req.count == 1 else "use ports from"
                notes.append(f"port {shown} is taken: {req.what} {uses} {start}")
        for port in range(start, start + req.count):
            taken[port] = req.flag
        first[i] = start
    return [first[i] for i in range(len(requests))], notes


def _free_run(host: str, count: int, avoid: set[int]) -> int:
    for _ in range(_SEARCH_TRIES):
        start = free_port(host)
        span = range(start, start + count)
        if span[-1] < 65536 and not avoid.intersection(span):
            if all(bind_error(host, p) is None for p in span):
                return start
    raise PortError(f"found no {count} free consecutive ports on {host}")


def up_ports(a: argparse.Namespace) -> argparse.Namespace:
    """`pagedserve up`'s arguments with every port decided: given ones checked, busy defaults
    replaced by free ports (said on stderr). Raises PortError."""
    requests = [
        PortRequest("the gateway", "--port", a.port, DEFAULT_HTTP_PORT),
        PortRequest("the control plane", "--grpc-port", a.grpc_port, DEFAULT_GRPC_PORT),
        PortRequest(
            "the worker" if a.workers <= 1 else "the workers",
            "--worker-base-port",
            a.worker_base_port,
            DEFAULT_WORKER_BASE_PORT,
            count=max(a.workers, 1),
        ),
    ]
    if a.redis_url is None:  # `up` starts redis-server: on the given port, or on a free one
        requests.append(PortRequest("redis-server", "--redis-port", a.redis_port or None, None))
    ports, notes = choose_ports(a.host, requests)
    for note in notes:
        print(note, file=sys.stderr, flush=True)
    out = argparse.Namespace(**vars(a))
    out.port, out.grpc_port, out.worker_base_port = ports[:3]
    if a.redis_url is None:
        out.redis_port = ports[3]
    return out
