"""Logging set-up, done once in main() (and again on reload): one structured path.

migd's own events go through structlog; the backends and libraries log through the
standard library (``logging.getLogger(__name__)``). Both end in one stdlib handler whose
structlog ``ProcessorFormatter`` renders every record the same way: JSON under systemd or
into a pipe or file, readable lines on a terminal, each with its level and timestamp (a
stdlib record also names its logger). So "GPU 3 left out of discovery" is a JSON line
with ``"level": "error"``, not bare text between JSON lines, and INFO records are kept.

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


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``stream``, or to whatever ``sys.stderr`` is when a record is emitted.

    Looking stderr up at each record (as logging's own last-resort handler does) keeps a
    replaced ``sys.stderr`` working, e.g. pytest's capture in tests that reload the daemon
    in-process, instead of writing to a stream that has since been closed.
    """

    def __init__(self, stream: TextIO | None) -> None:
        super().__init__(stream or sys.stderr)
        self._fixed = stream

    def emit(self, record: logging.LogRecord) -> None:
        if self._fixed is None:
            self.stream = sys.stderr  # handle() holds the handler's lock here
        super().emit(record)


HANDLER_NAME = "migd"


class _StdlibLoggers:
    """structlog's ``LoggerFactory``, remembering each stdlib logger by name.

    migd's module-level loggers are structlog proxies, and loggers are not cached on first
    use (a reload or a test that configures logging again must reach them), so every log
    call asks the factory for its logger again: ``logging.getLogger`` takes the logging
    module's lock each time, a measurable part of a lease cycle (issue 26 §4). A stdlib
    logger of a given name is the same object for the life of the process, so keeping it
    here changes nothing but the cost.
    """

    def __init__(self) -> None:
        self._factory = structlog.stdlib.LoggerFactory()
        self._loggers: dict[str, logging.Logger] = {}

    def __call__(self, *args: Any) -> logging.Logger:
        if not args or not isinstance(args[0], str):
            return self._factory(*args)  # named after the calling module: not cached
        logger = self._loggers.get(args[0])
        if logger is None:
            logger = self._loggers[args[0]] = self._factory(*args)
        return logger


def configure_logging(
    fmt: Literal["auto", "json", "console"] = "auto",
    level: str = "info",
    stream: TextIO | None = None,
) -> None:
    """Route structlog and stdlib logging into one handler on the root logger.

    Idempotent: a second call (reload) replaces the handler the first one installed.
    """
    target = stream or sys.stderr
    threshold = LEVELS.get(level, logging.INFO)
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    final: list[structlog.typing.Processor]
    if wants_json(fmt, target):
        renderer: structlog.typing.Processor = structlog.processors.JSONRenderer()
        if stderr_is_journal(target):
            renderer = JournalJSONRenderer()
        final = [structlog.processors.dict_tracebacks, renderer]
    else:
        final = [structlog.dev.ConsoleRenderer(colors=target.isatty())]
    formatter = structlog.stdlib.ProcessorFormatter(
        # a stdlib record (a backend's, a library's) gets what structlog's events get,
        # plus the name of the logger that wrote it
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    handler = _Handler(stream)
    handler.set_name(HANDLER_NAME)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == HANDLER_NAME]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(threshold)
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=_STDLIB_LOGGERS,
        cache_logger_on_first_use=False,
    )


_STDLIB_LOGGERS = _StdlibLoggers()
