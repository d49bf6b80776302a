"""Limits on a device's MPS daemon and servers, and its prestarted server.

The pinned-memory limit and the active thread percentage of the largest active share
are set as the daemon's defaults and on each running server, then read back: a
client can drop its own environment variables, so the server carries the bound.
"""

from __future__ import annotations

from collections.abc import Callable

from migd.core.mps import (
    MPS_CLIENT_DEVICE_INDEX,
    format_limit_mib,
    limit_applied,
    readable_limit_mib,
)

from .commands import DaemonCommands
from .errors import MpsCommandFailed
from .procs import live_pids, pid_alive
from .records import Daemon, write_record


def percentage_is(text: str, wanted: int) -> bool:
    """``get_*active_thread_percentage`` prints a float (``50.0``)."""
    try:
        return abs(float(text.strip()) - wanted) < 0.5
    except ValueError:
        return False


def apply_limits(cmds: DaemonCommands, daemon: Daemon) -> list[int] | None:
    """Limits on the daemon and each running server := the largest active share's.

    * Pinned memory: the largest share's per-client limit, as
      :func:`~migd.core.mps.readable_limit_mib` (rounded up to whole GiB from 1 GiB on,
      so that the read-back can confirm it).
    * Active thread percentage: the largest share's (a share without one counts as
      100). A client can only lower it through its environment (MPS docs,
      topic_5_2_5), and a job can unset that variable, so the server carries the
      bound too, as NVIDIA's device plugin (``cmd/mps-control-daemon/mps/daemon.go``)
      and DRA driver (``templates/mps-control-daemon.tmpl.yaml``) set it.

    Defaults reach servers started later, per-server values clients that connect
    later (MPS v2 interface docs), so both are set. Each change is checked by reading
    it back (``get_*``), not by the commands' output: what the daemon prints on
    success is not documented, so informational output is accepted and a refusal is
    what the follow-up query shows.

    Returns the live servers when it had to list them (``None`` if nothing changed).

    Raises:
        MpsCommandFailed: the daemon did not apply a limit.
    """
    record = daemon.record
    largest = max((s.memory_mib for s in daemon.shares.values()), default=0)
    target = readable_limit_mib(largest) if largest > 0 else 0
    threads = max((s.thread_percentage or 100 for s in daemon.shares.values()), default=100)
    memory_changes = target > 0 and target != record.default_limit_mib
    threads_change = bool(daemon.shares) and threads != record.thread_percentage
    if not memory_changes and not threads_change:
        return None
    # The daemon's default by the device's UUID *and* by index 0: they are separate
    # settings, and on an H200 (driver 580.159.04) the UUID's was the one new servers gave
    # their clients (1536M by UUID, then 2048M by index 0: clients got 1536M;
    # tests/data/mps_gpu_check/20261126T015109Z-h200/). NVIDIA/k8s-device-plugin#572 saw
    # UUID limits not apply on its drivers and moved to indices. Both set to one value:
    # whichever a driver gives clients, it is this one.
    dev = MPS_CLIENT_DEVICE_INDEX
    # Default first, then list: a server that starts in between already has it.
    if memory_changes:
        for name in (record.device_uuid, str(dev)):
            set_checked(
                cmds,
                daemon,
                f"set_default_device_pinned_mem_limit {name} {format_limit_mib(target)}",
                f"get_default_device_pinned_mem_limit {name}",
                lambda read: limit_applied(read, target),
            )
    if threads_change:
        set_checked(
            cmds,
            daemon,
            f"set_default_active_thread_percentage {threads}",
            "get_default_active_thread_percentage",
            lambda read: percentage_is(read, threads),
        )
    servers = live_pids(cmds.command(daemon, "get_server_list"))
    for pid in servers:
        if memory_changes:
            set_checked(
                cmds,
                daemon,
                f"set_device_pinned_mem_limit {pid} {dev} {format_limit_mib(target)}",
                f"get_device_pinned_mem_limit {pid} {dev}",
                lambda read: limit_applied(read, target),
                server=pid,
            )
        if threads_change:
            set_checked(
                cmds,
                daemon,
                f"set_active_thread_percentage {pid} {threads}",
                f"get_active_thread_percentage {pid}",
                lambda read: percentage_is(read, threads),
                server=pid,
            )
    if memory_changes:
        record.default_limit_mib = target
    record.thread_percentage = threads
    write_record(record)
    return servers


def set_checked(
    cmds: DaemonCommands,
    daemon: Daemon,
    command: str,
    query: str,
    applied: Callable[[str], bool],
    *,
    server: int | None = None,
) -> None:
    """Send ``command``, then ``query``; fail unless ``applied`` accepts the answer.

    A ``server`` that exited in between is not an error: nothing is left to set.

    Raises:
        MpsCommandFailed: the query does not show the change.
    """
    output = cmds.command(daemon, command)
    if server is not None and not pid_alive(server):
        return
    read = cmds.command(daemon, query)
    if not applied(read):
        raise not_applied(daemon, [command], output, read)


def not_applied(
    daemon: Daemon, commands: list[str], output: str, read_back: str
) -> MpsCommandFailed:
    said = " ".join(output.split()) or "no output"
    return MpsCommandFailed(
        f"MPS command(s) {'; '.join(commands)} for {daemon.record.device_uuid} did not "
        f"take effect (the daemon said: {said}; reading it back gave "
        f"{read_back.strip() or 'nothing'!r})",
        device_uuid=daemon.record.device_uuid,
        commands=commands,
    )


def ensure_server(cmds: DaemonCommands, daemon: Daemon, servers: list[int] | None = None) -> bool:
    """Start the daemon's server unless one runs; True if it had to start one.

    Whether ``start_server`` worked is read from ``get_server_list`` afterwards, not
    from its output (which may be informational). Updates ``daemon.known_servers``; the
    manager tells its server watchers.
    """
    if servers is None:
        servers = live_pids(cmds.command(daemon, "get_server_list"))
    started = not servers
    output = ""
    if started:
        output = cmds.command(daemon, f"start_server -uid {daemon.record.serves_uid}")
        servers = live_pids(cmds.command(daemon, "get_server_list"))
    if not servers:
        raise MpsCommandFailed(
            f"MPS server for uid {daemon.record.serves_uid} on "
            f"{daemon.record.device_uuid} did not start"
            + (f": {' '.join(output.split())}" if output.strip() else ""),
            device_uuid=daemon.record.device_uuid,
            log_dir=daemon.record.log_dir,
        )
    daemon.known_servers = set(servers)
    return started
