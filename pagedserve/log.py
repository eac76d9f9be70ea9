"""Structured logging: JSON lines in services, key=value on a terminal.

The format is `--log-format` (env PAGEDSERVE_LOG_FORMAT): auto (console on a terminal, else
json), json or console. Console lines are coloured on a terminal, or where FORCE_COLOR is set
(`pagedserve up` sets it for children whose lines it shows on a terminal) and NO_COLOR is not.
Every log line about a request carries `request_id` (bind it with `log.bind(request_id=...)`).
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

from pagedserve import envs

LOG_FORMATS = ("auto", "json", "console")


def resolve_format(log_format: str | None, tty: bool) -> str:
    """json or console: `log_format` (None: PAGEDSERVE_LOG_FORMAT, else auto), where auto
    means console for a terminal."""
    fmt = log_format or envs.get().log_format or "auto"
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    if fmt == "auto":
        return "console" if tty else "json"
    return fmt


def use_colors(tty: bool) -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    return tty or bool(os.environ.get("FORCE_COLOR"))


def configure_logging(
    component: str, log_format: str | None = None, level: str | None = None
) -> None:
    level_name = (level or envs.get().log_level).upper()
    tty = sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if resolve_format(log_format, tty) == "json"
        else structlog.dev.ConsoleRenderer(colors=use_colors(tty))
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


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB': sizes in log lines, in the units the size flags take."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("not reached")


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)  # type: ignore[no-any-return]
