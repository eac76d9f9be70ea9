"""Structured logging: JSON lines in services, key=value on a terminal.

Every log line about a request carries `request_id` (bind it with `log.bind(request_id=...)`).
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(component: str, level: str | None = None) -> None:
    level_name = (level or os.environ.get("PAGEDSERVE_LOG_LEVEL", "info")).upper()
    json_logs = os.environ.get("PAGEDSERVE_LOG_FORMAT", "auto")
    use_json = json_logs == "json" or (json_logs == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level_name, logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(component=component)


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)  # type: ignore[no-any-return]
