"""A second migd on the state or runtime directory of a running one is refused before it
touches anything (issue 23, section 1): exit 2, a message naming the holder, and the
first daemon's leases, queue and database exactly as they were."""

from __future__ import annotations

import contextlib
import socket
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.process.conftest import DaemonProcess, kill_strays, wait_for


def db_leases(state_dir: Path) -> list[tuple[str, str, float]]:
    """The leases table as stored, read-only (what a second daemon must not rewrite)."""
    uri = f"file:{state_dir / 'migd.db'}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
        rows = db.execute("SELECT lease_id, state, updated_s FROM leases ORDER BY lease_id")
        return [(str(a), str(b), float(c)) for a, b, c in rows]


@pytest.fixture
def second(daemon: DaemonProcess) -> Iterator[DaemonProcess]:
    root = daemon.root.with_name(daemon.root.name + "-2")
    root.mkdir()
    other = DaemonProcess(root)
    try:
        yield other
    finally:
        other.stop()
        kill_strays(root)
        if other.notify is not None:
            other.notify.close()
        subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.mark.parametrize("shared", ["state", "state+run+socket", "run"])
def test_a_second_daemon_on_the_same_state_or_runtime_is_refused_untouched(
    daemon: DaemonProcess, second: DaemonProcess, shared: str
) -> None:
    daemon.start()
    client = daemon.client()
    for n in range(2):  # both GPUs taken ...
        client.lease(job_id=f"{n}.0", gpu_memory_mib=40000, wait_s=5)
    waiting = []
    for n in (7, 8):  # ... so these two wait in the queue, their clients connected
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(daemon.socket_path))
        sock.sendall(
            b'{"version": 1, "op": "lease", "job_id": "%d.0", "gpu_memory_mib": 1000, '
            b'"wait_s": 120}\n' % n
        )
        waiting.append(sock)
    try:
        wait_for(lambda: len(client.status()["queue"]) == 2, what="two queued requests")
        before = client.call("leases", all=True)["leases"]
        stored = db_leases(daemon.root / "state")
        assert sorted(state for _, state, _ in stored) == ["active", "active", "queued", "queued"]

        if "state" in shared:
            second.extra_args += ["--state-dir", str(daemon.root / "state")]
        if "run" in shared:
            second.extra_args += ["--runtime-dir", str(daemon.root / "run")]
        if "socket" in shared:
            second.extra_args += ["--socket", str(daemon.socket_path)]
        second.start(wait_ready=False)
        try:
            code = second.wait(timeout_s=30)
        except subprocess.TimeoutExpired:
            code = None  # it started: what the old code did with another socket
        assert code == 2, second.log_path.read_text()
        log = second.log_path.read_text()
        assert "Traceback" not in log
        [failed] = [e for e in second.log_events() if e.get("event") == "daemon.start_failed"]
        assert failed["error"] == "already_running"
        assert f"another migd (pid {daemon.proc.pid})" in failed["message"]  # type: ignore[union-attr]
        assert "stop the other migd" in failed["hint"]
        assert "READY=1" not in second.read_notifications()

        # The first daemon serves on, its leases, queue and database as they were.
        assert client.call("leases", all=True)["leases"] == before
        assert len(client.status()["queue"]) == 2
        assert db_leases(daemon.root / "state") == stored
        assert daemon.proc is not None and daemon.proc.poll() is None
    finally:
        for sock in waiting:
            sock.close()


def test_the_lock_goes_with_the_process_so_a_restart_after_kill_starts(
    daemon: DaemonProcess,
) -> None:
    daemon.start()
    first = daemon.proc
    assert first is not None
    for directory in ("state", "run"):
        assert (daemon.root / directory / "migd.lock").read_text() == f"{first.pid}\n"
    first.kill()
    daemon.wait()
    daemon.notifications.clear()
    daemon.start()  # a kill -9 leaves the file behind, never a held lock
    assert daemon.proc is not first and daemon.proc is not None
    assert (daemon.root / "state" / "migd.lock").read_text() == f"{daemon.proc.pid}\n"
    assert daemon.client().ping()
