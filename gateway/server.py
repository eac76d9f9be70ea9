"""`pagedserve gateway`: the app under uvicorn. SIGINT/SIGTERM stop accepting connections
and let in-flight requests finish (up to graceful_shutdown_s) before exiting."""

from __future__ import annotations

import logging

import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.connections import EdgeLimits, guarded_protocol
from pagedserve.log import configure_logging, get_logger

log = get_logger(__name__)


def serve(config: GatewayConfig, log_format: str | None = None) -> None:
    """Serves until SIGINT/SIGTERM; `log_format` as `--log-format` (None: the environment's)."""
    configure_logging("gateway", log_format)
    # The gateway logs its own structured lines; keep uvicorn's to warnings and errors.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(logging.WARNING)
    app = create_app(config)
    log.info(
        "gateway_listening",
        url=f"http://{config.host}:{config.port}",
        control_plane=config.control_plane,
        api_key=config.api_key is not None,
    )
    uvicorn.run(
        app,
        host=config.host,
        port=config.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(config.graceful_shutdown_s),
        # httptools with read deadlines, a head cap, a connection cap and a write-stall bound
        # (gateway.connections).
        http=guarded_protocol(
            EdgeLimits(
                header_timeout_s=config.http_header_timeout_s,
                body_timeout_s=config.http_body_timeout_s,
                max_connections=config.max_connections,
                retry_after_s=config.retry_after_s,
                write_stall_timeout_s=config.stream_stall_timeout_s,
            )
        ),
    )
