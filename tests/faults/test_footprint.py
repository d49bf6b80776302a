"""Item 3: what one client can make migd store and send."""

from __future__ import annotations

import json
import subprocess

import pytest

from migd.errors import InvalidRequest
from tests.faults.clients import (
    seed_history,
    sleeper_of,
)
from tests.process.conftest import DaemonProcess

pytestmark = pytest.mark.slow


# -- 3. bounded footprint ------------------------------------------------------------------------


def test_reports_are_bounded_in_size_and_number(
    daemon: DaemonProcess, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    daemon.extra_args += ["--set", "api.max_reports_per_lease=10"]
    daemon.start()
    client = daemon.client()
    holder = sleeper_of(0, sleepers)
    lease = client.lease(job_id="3.0", gpu_memory_mib=4000, wait_s=10, holder_pid=holder)
    with pytest.raises(InvalidRequest, match="max_report_bytes"):
        client.call("report", lease_id=lease["lease_id"], event="note", data={"x": "y" * 60_000})
    for n in range(10):
        client.call("report", lease_id=lease["lease_id"], event="note", data={"n": n})
    with pytest.raises(InvalidRequest, match="max_reports_per_lease"):
        client.call("report", lease_id=lease["lease_id"], event="note", data={"n": 10})
    notes = client.call("history", job_id="3.0", limit=1000)["history"]
    assert len([row for row in notes if row["event"] == "wrapper.note"]) == 10


def test_history_replies_are_pages_of_bounded_size(
    daemon: DaemonProcess, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    daemon.start()
    seed_history(daemon, sleepers)
    client = daemon.client()
    seen: list[int] = []
    before: int | None = None
    pages = 0
    while True:
        reply = client.call("history", limit=10_000, before_id=before)
        size = len(json.dumps(reply["history"]))
        assert size <= 1024 * 1024 + 8192, size
        seen += [row["id"] for row in reply["history"]]
        pages += 1
        before = reply.get("next_before_id")
        if before is None:
            break
    assert pages >= 3
    assert seen == sorted(set(seen), reverse=True)  # every row once, newest first
    assert len(seen) >= 800
    # explain's history is bounded too (one job has ~800 KB of reports here)
    explained = client.call("explain", job_id="9.0")
    assert len(json.dumps(explained)) <= 512 * 1024 + 16 * 1024
