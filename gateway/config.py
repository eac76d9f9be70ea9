"""The gateway's configuration: one frozen dataclass, built from flags/env in pagedserve.cli."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.grpc_security import INSECURE, GrpcSecurity


@dataclass(frozen=True)
class GatewayConfig:
    control_plane: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer key required on /v1/*; None leaves the API open (local use).
    api_key: str | None = None
    # The model name clients use; None serves the control plane's own model id.
    served_model_name: str | None = None
    max_request_bytes: int = 4 << 20
    # One HTTP request's budget, all its prompts together (the control plane's defaults):
    # prompts x n x max_tokens, and the logprob entries those tokens and echoed prompts carry.
    max_request_tokens: int = 1 << 18
    max_logprob_entries: int = 1 << 20
    # How long a stopping gateway lets in-flight requests finish.
    graceful_shutdown_s: float = 30.0
    # Retry-After (seconds) sent with 429 when the control plane's queue is full.
    retry_after_s: int = 1
    # Deadline for the health and stats calls to the control plane.
    control_timeout_s: float = 2.0
    # How long a new request waits for the channel to the control plane to be ready (it may be
    # between reconnect attempts) before its 503.
    connect_wait_s: float = 0.5
    # The HTTP edge: a request's headers must arrive within http_header_timeout_s of the
    # connection opening (or of the previous response), its body within http_body_timeout_s
    # of its headers (408 otherwise); past max_connections open connections, a new one is
    # answered 503.
    http_header_timeout_s: float = 10.0
    http_body_timeout_s: float = 30.0
    max_connections: int = 1000
    # A client that reads nothing this long while output waits: its request aborted (while it
    # generates) and its connection closed, its unsent output dropped (generating or not).
    stream_stall_timeout_s: float = 60.0
    # Token and TLS for the channel to the control plane.
    grpc_security: GrpcSecurity = INSECURE

    def __post_init__(self) -> None:
        host, sep, port = self.control_plane.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"control plane address must be HOST:PORT, got {self.control_plane!r}")
        if not (0 < self.port < 65536):
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to turn keys off)")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.max_request_tokens < 1 or self.max_logprob_entries < 1:
            raise ValueError("max_request_tokens and max_logprob_entries must be >= 1")
        if self.stream_stall_timeout_s <= 0:
            raise ValueError("stream_stall_timeout_s must be positive")
        if self.graceful_shutdown_s < 0 or self.control_timeout_s <= 0 or self.retry_after_s < 0:
            raise ValueError("timeouts must be positive")
        if self.connect_wait_s < 0:
            raise ValueError(f"connect_wait_s must be >= 0, got {self.connect_wait_s}")
        if self.http_header_timeout_s <= 0 or self.http_body_timeout_s <= 0:
            raise ValueError("http_header_timeout_s and http_body_timeout_s must be positive")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
