"""One logging path: the backends' stdlib records come out as migd's structured lines."""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from migd.backends.simulated import simulated_backend
from migd.daemon.logs import HANDLER_NAME, configure_logging


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """configure_logging changes process-wide state: put it back for the other tests."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    structlog.reset_defaults()


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_backend_record_is_a_structured_line_with_its_level() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    structlog.get_logger("migd").info("daemon.starting", version="x")
    # what migd/backends/nvml/ writes when a GPU has fallen off the bus
    logging.getLogger("migd.backends.nvml").error("GPU %d left out of discovery: %s", 3, "lost")
    first, second = lines(out)
    assert first["event"] == "daemon.starting" and first["level"] == "info"
    assert second["event"] == "GPU 3 left out of discovery: lost"
    assert second["level"] == "error" and second["logger"] == "migd.backends.nvml"
    assert second.keys() >= {"timestamp"} and first.keys() >= {"timestamp"}


def test_the_real_backend_logs_a_lost_gpu_through_it() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    backend, node = simulated_backend("2xA100-40GB")
    node.lose_gpu(1)
    assert [g.index for g in backend.discover()] == [0]
    (line,) = lines(out)
    assert line["level"] == "error" and line["logger"] == "migd.backends.nvml"
    assert str(line["event"]).startswith("GPU 1 left out of discovery")


def test_info_is_kept_and_debug_follows_the_configured_level() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    node_log = logging.getLogger("migd.backends.simulated.node")
    node_log.info("simulated process %d no longer runs on the host", 4242)
    node_log.debug("not shown at info")
    structlog.get_logger("migd").debug("not shown either")
    assert [(x["level"], x["event"]) for x in lines(out)] == [
        ("info", "simulated process 4242 no longer runs on the host")
    ]
    out = io.StringIO()
    configure_logging("json", "debug", stream=out)
    node_log.debug("shown at debug")
    structlog.get_logger("migd").debug("shown too")
    assert [x["level"] for x in lines(out)] == ["debug", "debug"]


def test_under_systemd_a_stdlib_record_carries_its_journal_priority(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "journal"
    with path.open("w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        configure_logging("auto", "info", stream=stream)
        backend_log = logging.getLogger("migd.backends.nvml")
        backend_log.error("error")
        backend_log.warning("warning")
        backend_log.info("info")
        structlog.get_logger("migd").warning("structlog.warning")
    written = path.read_text().splitlines()
    assert [line[:3] for line in written] == ["<3>", "<4>", "<6>", "<4>"]
    assert [json.loads(line[3:])["level"] for line in written] == [
        "error",
        "warning",
        "info",
        "warning",
    ]


def test_an_exception_is_structured_not_a_bare_traceback() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("migd.backends.nvml").exception("shutdown failed")
        structlog.get_logger("migd").exception("work.crashed")
    stdlib, ours = lines(out)
    for line in (stdlib, ours):
        assert line["level"] == "error"
        (frame,) = line["exception"]  # type: ignore[misc]
        assert frame["exc_type"] == "RuntimeError" and frame["exc_value"] == "boom"


def test_console_format_renders_stdlib_records_too() -> None:
    out = io.StringIO()
    configure_logging("console", "info", stream=out)
    logging.getLogger("migd.backends.nvml").warning("nvmlShutdown failed: %s", "x")
    (line,) = out.getvalue().splitlines()
    assert "nvmlShutdown failed: x" in line and "warning" in line and not line.startswith("{")


def test_reconfiguring_replaces_the_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("json", "info", stream=first)
    configure_logging("json", "info", stream=second)  # a reload
    assert [h.get_name() for h in logging.getLogger().handlers].count(HANDLER_NAME) == 1
    logging.getLogger("migd.backends.nvml").warning("once")
    structlog.get_logger("migd").warning("once too")
    assert first.getvalue() == ""
    assert [x["event"] for x in lines(second)] == ["once", "once too"]


def test_a_module_logger_made_before_follows_each_configuration() -> None:
    """Each event's stdlib logger is remembered by name (issue 26 §4: looking it up on
    every event cost a lease cycle's time); the level and the stream still follow every
    configure_logging, as a reload's does."""
    module_log = structlog.get_logger("migd.test_module")  # as a module's, at import
    first, second = io.StringIO(), io.StringIO()
    configure_logging("json", "warning", stream=first)
    module_log.info("filtered")
    module_log.warning("kept")
    configure_logging("json", "debug", stream=second)
    module_log.debug("now kept")
    assert [x["event"] for x in lines(first)] == ["kept"]
    assert [x["event"] for x in lines(second)] == ["now kept"]
    assert logging.getLogger("migd.test_module") is logging.getLogger("migd.test_module")
