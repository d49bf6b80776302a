"""PsutilProcessTable against real processes of this host."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from migd.backends.procs import PsutilProcessTable
from migd.ports import ProcessTable


def _pid_that_cannot_exist() -> int:
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_it_is_a_process_table() -> None:
    assert isinstance(PsutilProcessTable(), ProcessTable)


def test_own_process_is_alive_with_its_start_time_and_uid() -> None:
    table = PsutilProcessTable()
    started = table.start_time(os.getpid())
    assert started is not None and started <= time.time()
    assert table.alive(os.getpid())
    assert table.alive(os.getpid(), started)
    assert table.uid(os.getpid()) == os.getuid()


def test_a_different_start_time_means_a_reused_pid(child: subprocess.Popen[bytes]) -> None:
    table = PsutilProcessTable()
    started = table.start_time(child.pid)
    assert started is not None
    assert table.alive(child.pid, started)
    assert not table.alive(child.pid, started - 1.0)  # same PID, another process's start


def test_exited_zombie_and_missing_processes_are_not_alive(child: subprocess.Popen[bytes]) -> None:
    table = PsutilProcessTable()
    child.kill()
    deadline = time.monotonic() + 10
    while table.alive(child.pid) and time.monotonic() < deadline:  # zombie until reaped
        time.sleep(0.01)
    assert not table.alive(child.pid)
    child.wait()
    assert not table.alive(child.pid)
    assert table.start_time(child.pid) is None and table.uid(child.pid) is None
    missing = _pid_that_cannot_exist()
    assert not table.alive(missing) and table.start_time(missing) is None
    assert not table.alive(0) and not table.alive(-5) and table.uid(-5) is None
