"""structlog set-up, done once in main(): JSON under systemd, readable on a terminal.

Under systemd (stderr is the journal's stream, ``JOURNAL_STREAM`` names it) every
JSON line starts with its sd-daemon(3) priority, ``<3>`` error, ``<4>`` warning,
``<6>`` info, ``<7>`` debug, which journald strips and stores as the entry's
priority, so ``journalctl -u migd -p warning`` shows warnings and errors only.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, Literal, TextIO

import structlog

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

# sd-daemon(3) / syslog priorities of structlog's level names.
PRIORITIES = {
    "debug": 7,
    "info": 6,
    "warning": 4,
    "warn": 4,
    "error": 3,
    "exception": 3,
    "critical": 2,
}


def stderr_is_journal(
    stream: TextIO | None = None, environ: Mapping[str, str] | None = None
) -> bool:
    """True if ``stream`` (stderr) is the journal stream systemd connected us to.

    systemd sets ``JOURNAL_STREAM=<device>:<inode>`` of that stream; a child whose stderr
    was redirected inherits the variable, so the numbers are compared (systemd.exec(5)).
    """
    env = os.environ if environ is None else environ
    value = env.get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep or not dev.isdigit() or not ino.isdigit():
        return False
    try:
        st = os.fstat((stream or sys.stderr).fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


def wants_json(fmt: Literal["auto", "json", "console"], stream: TextIO | None = None) -> bool:
    if fmt != "auto":
        return fmt == "json"
    # the journal and a pipe or file get JSON; a terminal gets readable lines
    stream = stream or sys.stderr
    return stderr_is_journal(stream) or not stream.isatty()


class JournalJSONRenderer:
    """JSON, prefixed with the line's sd-daemon priority (``<4>{"event": ...}``)."""

    def __init__(self) -> None:
        self._json = structlog.processors.JSONRenderer()

    def __call__(self, logger: Any, name: str, event_dict: Any) -> str:
        level = str(event_dict.get("level", name))
        rendered = self._json(logger, name, event_dict)
        if isinstance(rendered, bytes):  # pragma: no cover - only with a bytes serializer
            rendered = rendered.decode()
        return f"<{PRIORITIES.get(level, 6)}>{rendered}"


def configure_logging(
    fmt: Literal["auto", "json", "console"] = "auto",
    level: str = "info",
    stream: TextIO | None = None,
) -> None:
    stream = stream or sys.stderr
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if wants_json(fmt, stream):
        renderer: structlog.typing.Processor = structlog.processors.JSONRenderer()
        if stderr_is_journal(stream):
            renderer = JournalJSONRenderer()
        processors += [structlog.processors.dict_tracebacks, renderer]
    else:
        processors += [structlog.dev.ConsoleRenderer(colors=stream.isatty())]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
