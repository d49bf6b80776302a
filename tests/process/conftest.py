"""Run the real migd as a subprocess on simulated GPUs, in a temporary directory."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from migd.client import MigdClient


def wait_for(cond: Callable[[], Any], timeout_s: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


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

    @property
    def socket_path(self) -> Path:
        return self.root / "run" / "migd.sock"

    @property
    def config_path(self) -> Path:
        return self.root / "migd.toml"

    @property
    def log_path(self) -> Path:
        return self.root / "migd.log"

    def client(self, timeout_s: float = 10.0) -> MigdClient:
        return MigdClient(self.socket_path, timeout_s=timeout_s)

    def start(self, *, wait_ready: bool = True) -> None:
        (self.root / "run").mkdir(parents=True, exist_ok=True)
        (self.root / "run").chmod(0o755)
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
            *self.extra_args,
        ]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log, env=env)
        if wait_ready:
            wait_for(lambda: "READY=1" in self.read_notifications(), what="READY=1")

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

    def wait(self, timeout_s: float = 20.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)

    def log_events(self) -> list[dict[str, Any]]:
        events = []
        for line in self.log_path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        return events


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
        if proc.notify is not None:
            proc.notify.close()
        if proc.log_path.exists() and os.environ.get("MIGD_TEST_SHOW_LOGS"):
            print(proc.log_path.read_text())
        subprocess.run(["rm", "-rf", str(root)], check=False)
