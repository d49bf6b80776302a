"""Process helpers over ``/proc`` and ``kill(0)``: is a PID alive, is it an MPS daemon,
what environment it was started with, and a bounded wait for it to go.

The manager never signals or adopts a PID it has not checked here first: pid files
outlive their daemons, and PIDs get reused.
"""

from __future__ import annotations

import os
import pwd
import time
from pathlib import Path

# How often the manager polls for a pid file, a process exit or a server leaving NVML.
POLL_S = 0.02


def parse_pids(text: str) -> list[int]:
    return [int(word) for word in text.split() if word.isdigit()]


def live_pids(text: str) -> list[int]:
    """PIDs from a server list that still run (a crashed server may be listed until reaped)."""
    return [pid for pid in parse_pids(text) if pid_alive(pid)]


def read_pid(path: Path) -> int | None:
    try:
        text = path.read_text("utf-8").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (PID 1 may not reap re-parented daemons)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text("utf-8")
    except OSError:
        return True  # no procfs: trust kill(0)
    state = stat.rsplit(")", 1)[-1].split()[:1]
    return state != ["Z"]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, UnicodeDecodeError):
        return ""


def looks_like_mps_control(pid: int) -> bool:
    """Guards against a reused PID in a stale pid file (the fake's module name counts).

    An empty or unreadable command line (a kernel thread, a zombie, a process gone in
    between) is *not* an MPS daemon: it is never adopted, signalled or counted as ours.
    """
    line = cmdline(pid)
    return "mps-control" in line or "mps_control" in line


def looks_like_mps(pid: int) -> bool:
    """An MPS control daemon or server (``nvidia-cuda-mps-server``; the fake's servers
    are forks of its control process). Empty command lines do not count."""
    return "mps" in cmdline(pid)


def daemon_env_value(pid: int, name: str) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = name.encode() + b"="
    for item in environ:
        if item.startswith(prefix):
            return item.split(b"=", 1)[1].decode() or None
    return None


def daemon_visible_devices(pid: int) -> str | None:
    return daemon_env_value(pid, "CUDA_VISIBLE_DEVICES")


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def primary_gid(uid: int) -> int:
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return uid
