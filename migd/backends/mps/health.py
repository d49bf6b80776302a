"""What the MPS health check reports, and the daemon logs it reads.

:func:`diagnose` finds what is wrong with one daemon (pid alive, ``get_server_list``
answers, known servers still run, no new problem lines in the logs); what is done
about it (restart the daemon or its server) is the manager's
(:meth:`migd.backends.mps.MpsManager.check_health`), since it owns the registry and
the shares.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .commands import DaemonCommands
from .procs import live_pids, pid_alive
from .records import Daemon

CONTROL_LOG_NAME = "control.log"
SERVER_LOG_NAME = "server.log"


# Lines in control.log/server.log that mean trouble. The first two are the real
# daemon's wording (control logs quoted in NVIDIA/k8s-device-plugin#685: "Server
# encountered a fatal exception. Shutting down", "Server 95 exited with status 1").
# The third is cudaErrorDevicesUnavailable's text, which *clients* print when they
# cannot attach to the server (NVIDIA/k8s-device-plugin#647, #1118); whether the real
# daemon logs it is not verified, so the wrapper should also pass it on from the job's
# stderr (MpsManager.report_client_error).
# The fourth is what a real server logs when it turns a client away at its cap (H100,
# driver 580.159.04: tests/data/mps_gpu_check/20261128T022439Z-h100/server.log, step 10):
# a healthy device at capacity, never a reason to restart it.
CLIENT_CAP_LOG = re.compile(r"Maximum number of clients \((\d+)\) reached")
LOG_PROBLEMS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Server (\d+) exited with status ([1-9]\d*)"), "server_crashed"),
    (re.compile(r"Server encountered a fatal exception"), "server_crashed"),
    (re.compile(r"all CUDA-capable devices are busy or unavailable"), "devices_unavailable"),
    (CLIENT_CAP_LOG, "client_cap"),
)
# Which problem a scan reports when it finds several: a refusing device needs a restart,
# a crashed server a new server, a client past the cap nothing.
_RANK = {"client_cap": 0, "server_crashed": 1, "devices_unavailable": 2}
# What the refused client itself prints (CUDA error 808, cudaErrorMpsMaxClientsReached;
# the same recording's clients.jsonl), which the wrapper passes on.
CLIENT_CAP_MESSAGE = "the hardware resources required to create MPS client have been exhausted"


def worse(a: tuple[str, str] | None, b: tuple[str, str] | None) -> tuple[str, str] | None:
    """The more serious of two ``(problem, detail)`` findings (the first on a tie)."""
    if a is None or (b is not None and _RANK[b[0]] > _RANK[a[0]]):
        return b
    return a


# A server that ends normally (asked to by `quit`, a user hand-over or shutdown_server)
# logs status 0; its clients were done, so nothing is lost.
SERVER_EXIT_OK = re.compile(r"Server (\d+) exited with status 0\b")


@dataclass(frozen=True)
class HealthEvent:
    """One problem the health check found and what it did about it."""

    device_uuid: str
    # daemon_gone, daemon_unresponsive, server_crashed, devices_unavailable, client_cap
    problem: str
    detail: str
    action: str  # restarted_daemon, restarted_server, restart_failed, none
    ok: bool  # the device serves again
    # Whether clients were (or may have been) lost. A refused client (client cap, a
    # transient refusal) costs only itself: the others keep running, nothing to flag.
    clients_lost: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class HealthReport:
    events: tuple[HealthEvent, ...] = ()

    @property
    def affected_devices(self) -> tuple[str, ...]:
        """Devices whose clients were (or may have been) lost: their leases need a look."""
        return tuple(dict.fromkeys(e.device_uuid for e in self.events if e.clients_lost))

    @property
    def failed_devices(self) -> tuple[str, ...]:
        """Devices that could not be brought back: mark them unavailable."""
        return tuple(dict.fromkeys(e.device_uuid for e in self.events if not e.ok))


def log_files(daemon: Daemon) -> list[Path]:
    log_dir = Path(daemon.record.log_dir)
    return [log_dir / CONTROL_LOG_NAME, log_dir / SERVER_LOG_NAME]


def skip_old_log(daemon: Daemon) -> None:
    """Start reading the logs at their current end: what is there is not news."""
    for path in log_files(daemon):
        with contextlib.suppress(OSError):
            daemon.log_offsets[str(path)] = path.stat().st_size


def scan_logs(daemon: Daemon) -> tuple[tuple[str, str] | None, set[int]]:
    """The worst new problem line in the daemon's logs since the last scan, and the
    servers that logged a normal exit (status 0)."""
    found: tuple[str, str] | None = None
    exited_ok: set[int] = set()
    for path in log_files(daemon):
        offset = daemon.log_offsets.get(str(path), 0)
        try:
            with path.open("rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < offset:  # rotated or truncated
                    offset = 0
                fh.seek(offset)
                text = fh.read().decode("utf-8", "replace")
                daemon.log_offsets[str(path)] = size
        except OSError:
            continue
        for line in text.splitlines():
            normal = SERVER_EXIT_OK.search(line)
            if normal is not None:
                exited_ok.add(int(normal.group(1)))
            for pattern, kind in LOG_PROBLEMS:
                if pattern.search(line):
                    found = worse(found, (kind, line.strip()))
    return found, exited_ok


def diagnose(daemon: Daemon, cmds: DaemonCommands) -> tuple[str, str] | None:
    """The daemon's problem now as ``(problem, detail)``, ``None`` if it is healthy.

    ``problem`` is ``daemon_gone``, ``daemon_unresponsive``, ``devices_unavailable``,
    ``server_crashed`` or ``client_cap`` (a client turned away at the cap). Updates
    ``daemon.known_servers`` to the servers it lists, except when the device refuses
    clients (the daemon is restarted then anyway); consumes a client's report and the new
    log lines.
    """
    if not pid_alive(daemon.record.pid):
        return "daemon_gone", f"control daemon {daemon.record.pid} is gone"
    answered = cmds.try_command(daemon, "get_server_list")
    if answered is None:
        return "daemon_unresponsive", daemon.last_error
    servers = set(live_pids(answered))
    scanned, exited_ok = scan_logs(daemon)
    # A server that logged a normal exit had no clients left: not a crash.
    lost = sorted(p for p in daemon.known_servers if p not in servers and p not in exited_ok)
    log_problem = worse(daemon.reported, scanned)
    daemon.reported = None
    if log_problem is not None and log_problem[0] == "devices_unavailable":
        return log_problem
    daemon.known_servers = servers
    if log_problem is not None and log_problem[0] == "server_crashed":
        return log_problem
    if lost:
        return "server_crashed", f"MPS server(s) {', '.join(map(str, lost))} exited"
    return log_problem  # None, or a client turned away at the cap
