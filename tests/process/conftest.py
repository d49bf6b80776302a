"""Run the real migd as a subprocess on simulated GPUs, in a temporary directory."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from migd.client import MigdClient
from tests.waiting import limit, wait_for

__all__ = ["DaemonProcess", "limit", "wait_for"]


@dataclass
class DaemonProcess:
    root: Path
    simulate: str = "2xA100-40GB"
    config_text: str = ""
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    notify: socket.socket | None = None
    notifications: list[str] = field(default_factory=list)
    # Every test ends with SIGTERM; a daemon that did not stop then (systemd would SIGKILL
    # it at TimeoutStopSec) fails its test in the fixtures' teardown.
    hung_on_sigterm: bool = False

    @property
    def socket_path(self) -> Path:
        return self.root / "run" / "migd.sock"

    @property
    def config_path(self) -> Path:
        return self.root / "migd.toml"

    @property
    def log_path(self) -> Path:
        return self.root / "migd.log"

    def client(self, timeout_s: float = 30.0) -> MigdClient:
        return MigdClient(self.socket_path, timeout_s=timeout_s)

    def start(self, *, wait_ready: bool = True) -> None:
        (self.root / "run").mkdir(parents=True, exist_ok=True)
        (self.root / "run").chmod(0o755)
        # HTCondor's tools as migd calls them (condor section): a recorder, so no test
        # depends on, or reconfigures, an HTCondor the host may have.
        condor_tool = self.root / "condor-tool"
        condor_tool.write_text(
            '#!/bin/sh\nif [ "$1" = MIGD_SHARES_PER_GPU ]; then echo 7; exit 0; fi\n'
            f'echo "$*" >> {self.root / "condor-tool.log"}\n'
        )
        condor_tool.chmod(0o755)
        self.config_path.write_text(self.config_text or "version = 1\n")
        if self.notify is None:
            self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self.notify.bind(str(self.root / "notify.sock"))
            self.notify.setblocking(False)
        env = {
            **os.environ,
            "NOTIFY_SOCKET": str(self.root / "notify.sock"),
            "WATCHDOG_USEC": "2000000",
            "PYTHONFAULTHANDLER": "1",
            **self.env,
        }
        env.pop("WATCHDOG_PID", None)
        args = [
            sys.executable,
            "-m",
            "migd",
            "--config",
            str(self.config_path),
            "--simulate",
            self.simulate,
            "--state-dir",
            str(self.root / "state"),
            "--runtime-dir",
            str(self.root / "run"),
            "--socket",
            str(self.socket_path),
            "--log-format",
            "json",
            "--set",
            "reaper.interval_s=0.2",
            # NVML creates and destroys are instant unless a test asks for real latencies
            # (--set backend.sim_time_scale=1 in its extra_args, which come after).
            "--set",
            "backend.sim_time_scale=0",
            "--set",
            f'htcondor.reconfig_command=["{condor_tool}", "-daemon", "startd"]',
            "--set",
            f'htcondor.shares_command=["{condor_tool}", "MIGD_SHARES_PER_GPU"]',
            *self.extra_args,
        ]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log, env=env)
        if wait_ready:
            # Start-up took 3-7 s on a 2-core host at load 15; a daemon that exited will
            # never be ready, so that ends the wait at once, with its log's last lines.
            wait_for(
                lambda: "READY=1" in self.read_notifications(),
                timeout_s=120,
                what="READY=1 from migd",
                give_up=self._exited,
            )

    def _exited(self) -> str | None:
        if self.proc is None or self.proc.poll() is None:
            return None
        tail = self.log_path.read_text(errors="replace").splitlines()[-5:]
        return f"migd exited with {self.proc.returncode}; its log ends: " + " | ".join(tail)

    def read_notifications(self) -> str:
        assert self.notify is not None
        while True:
            try:
                self.notifications.append(self.notify.recv(4096).decode())
            except BlockingIOError:
                break
        return "\n".join(self.notifications)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(limit(timeout_s))

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(limit(60))
        except subprocess.TimeoutExpired:
            self.hung_on_sigterm = True
            self.proc.kill()
            return self.proc.wait(5)

    def migctl(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        """``migctl ARGS`` against this daemon, as an admin runs it (exit code and output
        kept for the test to check)."""
        return subprocess.run(
            [sys.executable, "-m", "migd.cli.migctl", "--socket", str(self.socket_path), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def status_json(self) -> dict[str, Any]:
        """``migctl status --json``, which must succeed."""
        result = self.migctl("status", "--json")
        assert result.returncode == 0, result.stderr
        status: dict[str, Any] = json.loads(result.stdout)
        return status

    def log_events(self) -> list[dict[str, Any]]:
        events = []
        for line in self.log_path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        return events


def strays(root: Path) -> dict[int, int]:
    """Live processes (pid -> process group) that belong to a test's ``root``: their
    command line names a path under it, or their environment does (the MPS daemons'
    ``CUDA_MPS_PIPE_DIRECTORY``)."""
    mark = f"{root}/"
    found: dict[int, int] = {}
    for proc in psutil.process_iter(["pid", "cmdline", "environ", "status"]):
        info = proc.info
        if info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        cmdline = info.get("cmdline") or []
        environ = info.get("environ") or {}
        if any(mark in arg for arg in cmdline) or any(
            str(v).startswith(mark) for v in environ.values()
        ):
            with contextlib.suppress(ProcessLookupError):
                found[info["pid"]] = os.getpgid(info["pid"])
    return found


def kill_strays(root: Path) -> None:
    """SIGKILL the process groups of every process that belongs to a test's ``root``.

    The MPS control daemons migd starts (the stand-in ``fake_mps_control``) detach into
    their own session, so stopping or killing migd leaves them running (by design: they
    serve jobs across a restart); their servers share their group.
    """
    for pgid in set(strays(root).values()) - {os.getpgrp()}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    wait_for(lambda: not strays(root), timeout_s=30, what=f"the processes of {root} to end")


@contextlib.contextmanager
def started_daemon(
    tmp_path: Path, tag: str, config: Callable[[Path], str] | None = None, **options: Any
) -> Iterator[DaemonProcess]:
    """A started migd (``DaemonProcess(root, **options)``) in a short root of its own
    (``tag`` tells the tests' roots apart), stopped and cleaned up afterwards. ``config``
    makes the config text from the root, for settings that name paths under it."""
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"migd-{tag}{os.getpid()}-{tmp_path.name[-16:]}"
    root.mkdir(parents=True, exist_ok=True)
    if config is not None:
        options["config_text"] = config(root)
    proc = DaemonProcess(root, **options)
    try:
        proc.start()
        yield proc
    finally:
        if os.environ.get("MIGD_TEST_SHOW_LOGS") and proc.log_path.exists():
            print(proc.log_path.read_text())
        proc.stop()
        kill_strays(root)
        if proc.notify is not None:
            proc.notify.close()
        subprocess.run(["rm", "-rf", str(root)], check=False)
        if proc.hung_on_sigterm:
            pytest.fail("migd did not stop within 20 s of SIGTERM (it was SIGKILLed)")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    # Unix socket paths are limited to ~107 bytes; pytest's tmp paths can be long.
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"migd-{os.getpid()}-{tmp_path.name[-20:]}"
    root.mkdir(parents=True, exist_ok=True)
    proc = DaemonProcess(root)
    try:
        yield proc
    finally:
        if os.environ.get("MIGD_TEST_ABORT") and proc.proc is not None and proc.proc.poll() is None:
            proc.proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
            proc.proc.wait(10)
        proc.stop()
        kill_strays(root)  # MPS daemons that outlive migd by design
        if proc.notify is not None:
            proc.notify.close()
        if proc.log_path.exists() and os.environ.get("MIGD_TEST_SHOW_LOGS"):
            print(proc.log_path.read_text())
        subprocess.run(["rm", "-rf", str(root)], check=False)
        if proc.hung_on_sigterm:
            pytest.fail("migd did not stop within 20 s of SIGTERM (it was SIGKILLed)")
