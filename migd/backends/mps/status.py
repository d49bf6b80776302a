"""What ``migctl status`` shows of each MPS control daemon, and how it is read."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from migd.core.mps import MPS_CLIENT_DEVICE_INDEX, parse_limit_mib
from migd.errors import MpsError
from migd.ports import Clock

from .commands import DaemonCommands
from .procs import parse_pids
from .records import Daemon


@dataclass(frozen=True)
class MpsDaemonStatus:
    """One control daemon as ``migctl status`` shows it."""

    device_uuid: str
    pid: int
    uid: int
    serves_uid: int
    multi_user: bool
    pipe_dir: str
    log_dir: str
    servers: tuple[int, ...]
    clients: tuple[int, ...]
    default_limit_mib: int | None
    shares: int
    healthy: bool
    last_error: str
    started_at: float
    idle_for_s: float | None
    scope_unit: str = ""
    # Clients refused while others ran (not restarted for), and the most clients that
    # were connected at such a refusal: the device's client cap as seen.
    refused_clients: int = 0
    clients_at_refusal: int | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["servers"] = list(self.servers)
        data["clients"] = list(self.clients)
        return data


def recorded_status(daemon: Daemon) -> MpsDaemonStatus:
    """The daemon as migd's own record has it, without asking it (no clients)."""
    record = daemon.record
    return MpsDaemonStatus(
        device_uuid=record.device_uuid,
        pid=record.pid,
        uid=record.uid,
        serves_uid=record.serves_uid,
        multi_user=record.multi_user,
        pipe_dir=record.pipe_dir,
        log_dir=record.log_dir,
        servers=tuple(sorted(daemon.known_servers)),
        clients=(),
        default_limit_mib=record.default_limit_mib or None,
        shares=len(daemon.shares),
        healthy=daemon.healthy,
        last_error=daemon.last_error,
        started_at=record.started_at,
        idle_for_s=None,
        scope_unit=record.scope_unit,
        refused_clients=daemon.refusals,
        clients_at_refusal=daemon.clients_at_refusal,
    )


def status_of(daemon: Daemon, cmds: DaemonCommands, clock: Clock) -> MpsDaemonStatus:
    """The daemon as it answers now (every server it lists, live or not)."""
    servers: tuple[int, ...] = ()
    clients: list[int] = []
    limit: int | None = None
    healthy, error = daemon.healthy, daemon.last_error
    try:
        servers = tuple(parse_pids(cmds.command(daemon, "get_server_list")))
        clients.extend(cmds.clients(daemon, servers))
        limit = parse_limit_mib(
            cmds.command(daemon, f"get_default_device_pinned_mem_limit {MPS_CLIENT_DEVICE_INDEX}")
        )
    except MpsError as exc:
        healthy, error = False, str(exc)
    idle = daemon.idle_since
    return replace(
        recorded_status(daemon),
        servers=servers,
        clients=tuple(sorted(clients)),
        default_limit_mib=limit,
        healthy=healthy,
        last_error=error,
        idle_for_s=None if idle is None else clock.monotonic() - idle,
    )


def cached_status(
    daemon: Daemon, cached: tuple[dict[str, Any], float] | None, now: float
) -> dict[str, Any]:
    """The daemon's status from ``cached`` (its dict and the monotonic time it was read),
    with ``age_s``; from migd's own record (``age_s`` ``None``) if the cache has none for
    this daemon's pid (started since the last refresh)."""
    if cached is not None and cached[0].get("pid") == daemon.record.pid:
        data = dict(cached[0])
        data["age_s"] = round(max(0.0, now - cached[1]), 3)
    else:
        data = recorded_status(daemon).to_dict()
        data["age_s"] = None
    # Shares and health change under migd's own hand: always current.
    data["shares"] = len(daemon.shares)
    data["refused_clients"] = daemon.refusals
    data["clients_at_refusal"] = daemon.clients_at_refusal
    data["healthy"] = daemon.healthy and bool(data.get("healthy", True))
    if daemon.last_error:
        data["last_error"] = daemon.last_error
    return data
