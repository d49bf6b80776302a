"""structlog set-up, done once in main(): JSON under systemd, readable on a terminal."""

from __future__ import annotations

import logging
import os
import sys
from typing import Literal

import structlog

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def wants_json(fmt: Literal["auto", "json", "console"]) -> bool:
    if fmt != "auto":
        return fmt == "json"
    # journald sets JOURNAL_STREAM for services; a pipe or file also gets JSON
    return bool(os.environ.get("JOURNAL_STREAM")) or not sys.stderr.isatty()


def configure_logging(
    fmt: Literal["auto", "json", "console"] = "auto", level: str = "info"
) -> None:
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if wants_json(fmt):
        processors += [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    else:
        processors += [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
