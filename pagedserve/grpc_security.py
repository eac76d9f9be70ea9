"""Who may call the internal gRPC services: a shared token, TLS and mTLS.

Servers (worker, control plane) check `authorization: Bearer <token>` metadata once per call in
a server interceptor, so an Execute stream pays for it when it opens, not per message; the
standard grpc.health.v1 service answers without it (Kubernetes' gRPC probes cannot send
metadata). Clients (control plane, gateway, CLI) get channels that add the token to every call
they start: a wrapper around the stub-facing methods, because a grpc.aio client interceptor
would put every message of the Execute stream through an extra queue and task.

TLS is on for a server given a certificate and key; a CA makes it mTLS (client certificates
required and verified). A client speaks TLS when given a CA (which it verifies the server
against) or a certificate (then the system roots verify the server), and presents its
certificate as the client certificate. docs/architecture.md ("Trust model") has the whole.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from pagedserve import envs

# Calls under these prefixes need no token: health says SERVING or not, nothing more.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
TOKEN_FLAG = "--grpc-token / PAGEDSERVE_GRPC_TOKEN"


@dataclass(frozen=True)
class GrpcSecurity:
    """One process's gRPC credentials; the same for what it serves and what it calls."""

    # The shared secret sent and required as `authorization: Bearer`; kept out of repr (logs).
    token: str | None = field(default=None, repr=False)
    cert_file: str | None = None  # PEM certificate: served, and presented as a client cert
    key_file: str | None = None  # its PEM private key
    ca_file: str | None = None  # PEM CA bundle: verifies servers; as a server, requires mTLS

    def __post_init__(self) -> None:
        if self.token is not None and not (
            self.token.isascii() and self.token.isprintable() and " " not in self.token
        ):
            raise ValueError("the gRPC token must be printable ASCII without spaces")
        if self.token == "":
            raise ValueError("the gRPC token must not be empty (leave it unset to turn it off)")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("--tls-cert-file and --tls-key-file go together")
        for flag, path in (
            ("--tls-cert-file", self.cert_file),
            ("--tls-key-file", self.key_file),
            ("--tls-ca-file", self.ca_file),
        ):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")

    @property
    def server_tls(self) -> bool:
        return self.cert_file is not None

    @property
    def client_tls(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


INSECURE = GrpcSecurity()


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path is not None else None


# -- servers --------------------------------------------------------------------------------------


class _TokenCheck:
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def refusal(self, details: grpc.HandlerCallDetails) -> str | None:
        """None when the call may go on, else why not."""
        if details.method.startswith(OPEN_METHOD_PREFIXES):
            return None
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                got = value if isinstance(value, bytes) else value.encode()
                if hmac.compare_digest(got, self._expected):
                    return None
                return f"the gRPC token is wrong ({TOKEN_FLAG})"
        return f"this server requires a gRPC token: set {TOKEN_FLAG}"


def _denying(handler: Any, behaviour: Callable[..., Any]) -> Any:
    """A handler of the same kind as `handler` whose every call runs `behaviour`."""
    if handler is None:  # an unknown method: the server answers UNIMPLEMENTED itself
        return None
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class TokenInterceptor(grpc.ServerInterceptor):
    """For a grpc.server (the worker's thread-pool server)."""

    def __init__(self, token: str) -> None:
        self._check = _TokenCheck(token)

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], details: Any
    ) -> Any:
        why = self._check.refusal(details)
        if why is None:
            return continuation(details)

        def refuse(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        return _denying(continuation(details), refuse)


class AioTokenInterceptor(grpc.aio.ServerInterceptor):
    """For a grpc.aio.server (the control plane)."""

    def __init__(self, token: str) -> None:
        self._check = _TokenCheck(token)

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        why = self._check.refusal(details)
        if why is None:
            return await continuation(details)

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

        return _denying(await continuation(details), refuse)


def server(security: GrpcSecurity, executor: Any, options: Sequence[tuple[str, Any]]) -> Any:
    """A grpc.server checking the token, if there is one."""
    interceptors = [TokenInterceptor(security.token)] if security.token else []
    return grpc.server(executor, options=options, interceptors=interceptors)


def aio_server(security: GrpcSecurity, options: Sequence[tuple[str, Any]]) -> grpc.aio.Server:
    """A grpc.aio.server checking the token, if there is one."""
    interceptors = [AioTokenInterceptor(security.token)] if security.token else []
    return grpc.aio.server(options=options, interceptors=interceptors)


def add_port(server: Any, address: str, security: GrpcSecurity) -> int:
    """Listens on address: TLS with a certificate, mTLS with a CA too, else plaintext."""
    if not security.server_tls:
        return int(server.add_insecure_port(address))
    key, cert, ca = _read(security.key_file), _read(security.cert_file), _read(security.ca_file)
    credentials = grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )
    return int(server.add_secure_port(address, credentials))


def caller_identity(context: grpc.aio.ServicerContext) -> str:
    """Who is calling: the client certificate's names under mTLS, else the connection
    (`ipv4:10.0.0.7:51234`), which is the same for every call a client makes on one channel."""
    names = context.peer_identities()
    if names:
        return "x509:" + ",".join(n.decode(errors="replace") for n in names)
    return str(context.peer())


class RequestOwners:
    """Who started each running request, so that only they can abort it."""

    def __init__(self) -> None:
        self._owners: dict[str, tuple[str, object]] = {}

    def record(self, request_id: str, context: grpc.aio.ServicerContext) -> None:
        """Call once the request is admitted; the entry goes when its call ends."""
        release = self.claim(request_id, context)
        context.add_done_callback(lambda _: release())

    def claim(self, request_id: str, context: grpc.aio.ServicerContext) -> Callable[[], None]:
        """Records the request's owner; the entry goes when the function returned is called
        (a call that carries many requests ends each of them on its own)."""
        entry = (caller_identity(context), object())
        self._owners[request_id] = entry

        def forget() -> None:
            # A later request may reuse the id once this one has ended: leave its entry.
            if self._owners.get(request_id) is entry:
                del self._owners[request_id]

        return forget

    def owns(self, request_id: str, context: grpc.aio.ServicerContext) -> bool:
        entry = self._owners.get(request_id)
        return entry is not None and entry[0] == caller_identity(context)


# -- clients --------------------------------------------------------------------------------------


def channel_credentials(security: GrpcSecurity) -> grpc.ChannelCredentials | None:
    if not security.client_tls:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(security.ca_file),
        private_key=_read(security.key_file),
        certificate_chain=_read(security.cert_file),
    )


class _WithMetadata:
    """A stub's multicallable that sends the token with every call it starts."""

    __slots__ = ("_callable", "_metadata")

    def __init__(self, multicallable: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self._callable = multicallable
        self._metadata = metadata

    def _sent(self, metadata: Iterable[Any] | None) -> tuple[Any, ...]:
        return self._metadata if metadata is None else (*self._metadata, *metadata)

    def __call__(self, *args: Any, metadata: Iterable[Any] | None = None, **kw: Any) -> Any:
        return self._callable(*args, metadata=self._sent(metadata), **kw)

    def with_call(self, *args: Any, metadata: Iterable[Any] | None = None, **kw: Any) -> Any:
        return self._callable.with_call(*args, metadata=self._sent(metadata), **kw)

    def future(self, *args: Any, metadata: Iterable[Any] | None = None, **kw: Any) -> Any:
        return self._callable.future(*args, metadata=self._sent(metadata), **kw)


class _AioTokenChannel(grpc.aio.Channel):
    def __init__(self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
        self._channel = channel
        self._metadata = metadata

    async def __aenter__(self) -> _AioTokenChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._channel.close(None)

    async def close(self, grace: float | None = None) -> None:
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self._channel.get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channel.channel_ready()

    def unary_unary(self, *args: Any, **kw: Any) -> Any:
        return _WithMetadata(self._channel.unary_unary(*args, **kw), self._metadata)

    def unary_stream(self, *args: Any, **kw: Any) -> Any:
        return _WithMetadata(self._channel.unary_stream(*args, **kw), self._metadata)

    def stream_unary(self, *args: Any, **kw: Any) -> Any:
        return _WithMetadata(self._channel.stream_unary(*args, **kw), self._metadata)

    def stream_stream(self, *args: Any, **kw: Any) -> Any:
        return _WithMetadata(self._channel.stream_stream(*args, **kw), self._metadata)


class _TokenChannel(grpc.Channel):
    def __init__(self, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
        self._channel = channel
        self._metadata = metadata

    def __enter__(self) -> _TokenChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self._channel.close()

    def close(self) -> None:
        self._channel.close()

    def subscribe(self, callback: Callable[..., Any], try_to_connect: bool = False) -> None:
        self._channel.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback: Callable[..., Any]) -> None:
        self._channel.unsubscribe(callback)

    def unary_unary(self, *args: Any, **kw: Any) -> Any:
        return _WithMetadata(self._channel.unary_unary(*args, **kw), self._metadata)

    def unary_stream(self, *args: Any, **kw: Any) -> Any:
        return _WithMetadata(self._channel.unary_stream(*args, **kw), self._metadata)

    def stream_unary(self, *args: Any, **kw: Any) -> Any:
        return _WithMetadata(self._channel.stream_unary(*args, **kw), self._metadata)

    def stream_stream(self, *args: Any, **kw: Any) -> Any:
        return _WithMetadata(self._channel.stream_stream(*args, **kw), self._metadata)


# -- the token `pagedserve up` leaves for the CLI ------------------------------------------------


def token_path(address: str) -> Path:
    """Where `pagedserve up` leaves the token of the control plane at address: under
    $PAGEDSERVE_CACHE_DIR (default ~/.cache/pagedserve), so only a client with the same setting
    finds it."""
    return envs.get().cache_root / "grpc-tokens" / address.replace("/", "_")


def save_token(address: str, token: str) -> Path:
    """Leaves the token of the control plane at address where this user's `pagedserve
    generate` / `stats` find it (readable by this user only); returns the file."""
    path = token_path(address)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.replace(tmp, path)
    return path


def saved_token_line(path: Path) -> str:
    """What `pagedserve up` says about the token file it left: a client looks for it only under
    the same PAGEDSERVE_CACHE_DIR."""
    cache = envs.get().cache_dir
    where = f" with PAGEDSERVE_CACHE_DIR={cache}" if cache else ""
    return f"gRPC token saved in {path}: `pagedserve generate` and `stats` find it there{where}"


def saved_token(address: str) -> str | None:
    try:
        return token_path(address).read_text().strip() or None
    except OSError:
        return None


def aio_channel(
    address: str, security: GrpcSecurity, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """A grpc.aio channel to address: TLS when configured, the token on every call."""
    credentials = channel_credentials(security)
    if credentials is None:
        plain = grpc.aio.insecure_channel(address, options=options)
    else:
        plain = grpc.aio.secure_channel(address, credentials, options=options)
    return _AioTokenChannel(plain, security.metadata) if security.token else plain


def channel(
    address: str, security: GrpcSecurity, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A blocking channel to address (the CLI's clients and health checks)."""
    credentials = channel_credentials(security)
    if credentials is None:
        plain = grpc.insecure_channel(address, options=options)
    else:
        plain = grpc.secure_channel(address, credentials, options=options)
    return _TokenChannel(plain, security.metadata) if security.token else plain
