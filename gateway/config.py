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
    # How long a stopping gateway lets in-flight requests finish.
    graceful_shutdown_s: float = 30.0
    # Retry-After (seconds) sent with 429 when the control plane's queue is full.
    retry_after_s: int = 1
    # Deadline for the health, stats and model-list calls to the control plane.
    control_timeout_s: float = 2.0
    # A streaming client that reads nothing this long while output waits: its request aborted.
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
        if self.stream_stall_timeout_s <= 0:
            raise ValueError("stream_stall_timeout_s must be positive")
        if self.graceful_shutdown_s < 0 or self.control_timeout_s <= 0 or self.retry_after_s < 0:
            raise ValueError("timeouts must be positive")
