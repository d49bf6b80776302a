"""The MPS manager: one control daemon per MPS device, started on demand.

:class:`MpsManager` coordinates; the package's other modules do the parts (see
:mod:`migd.backends.mps` for the design): :mod:`.lifecycle` starts and stops one
daemon, :mod:`.commands` talks to it, :mod:`.limits` sets its limits and server,
:mod:`.health` finds what is wrong, :mod:`.status` reads what ``migctl status`` shows
and :mod:`.records` keeps its files. The manager keeps the registry of daemons, one
lock per device, the shares on each and the status cache.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from migd.core.mps import MpsShare, share_environment
from migd.errors import MpsError
from migd.ports import Clock, SystemClock

from .commands import DaemonCommands
from .config import MpsManagerConfig
from .errors import MpsDeviceBusy
from .health import CLIENT_CAP_LOG, CLIENT_CAP_MESSAGE, HealthEvent, HealthReport, diagnose
from .lifecycle import DaemonLauncher
from .limits import apply_limits, ensure_server
from .procs import live_pids, looks_like_mps_control, pid_alive, read_pid
from .records import (
    PID_FILE_NAME,
    AdoptionReport,
    Daemon,
    MpsLayout,
    read_record,
    record_for_foreign,
    remove_stale,
    write_record,
)
from .runner import CommandRunner, SubprocessRunner
from .status import MpsDaemonStatus, cached_status, status_of

if TYPE_CHECKING:
    from migd.core.leases import Lease


class MpsManager:
    """Starts, watches and stops the per-device MPS control daemons.

    Thread-safe: calls for different devices may run at once; calls for one device
    are serialised.

    Args:
        runtime_dir: migd's runtime directory (``/run/migd``); daemons live under
            ``<runtime_dir>/mps``. It must be traversable by job users (0755).
        config: ``[mps]`` settings.
        runner: how commands run (default :class:`SubprocessRunner`).
        clock: for idle times (default the system clock).
    """

    def __init__(
        self,
        runtime_dir: Path,
        config: MpsManagerConfig | None = None,
        *,
        runner: CommandRunner | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.config = config or MpsManagerConfig()
        self.root = Path(runtime_dir) / "mps"
        self._clock: Clock = clock or SystemClock()
        self._layout = MpsLayout(self.root)
        self._commands = DaemonCommands(self.config, runner or SubprocessRunner())
        self._launcher = DaemonLauncher(self.config, self._commands, self._layout, self._clock)
        self._daemons: dict[str, Daemon] = {}
        self._registry_lock = threading.Lock()
        self._device_locks: dict[str, threading.RLock] = {}
        # device -> (status dict, monotonic time it was read): what `migctl status` shows,
        # refreshed off the daemon's event loop by refresh_status() (never blocks a reader).
        self._status_cache: dict[str, tuple[dict[str, Any], float]] = {}
        self._server_watchers: list[Callable[[str, Collection[int]], None]] = []

    # -- paths

    @staticmethod
    def dir_name(device_uuid: str) -> str:
        """Directory name for a device: the UUID, with the legacy MIG form's ``/`` as ``_``."""
        return MpsLayout.dir_name(device_uuid)

    def device_dir(self, device_uuid: str) -> Path:
        return self._layout.device_dir(device_uuid)

    def pipe_dir(self, device_uuid: str) -> Path:
        return self._layout.pipe_dir(device_uuid)

    def log_dir(self, device_uuid: str, uid: int | None = None) -> Path:
        """The log directory of the daemon that serves ``uid`` on the device (see
        :meth:`MpsLayout.log_dir`); ``uid=None`` is the device's log root."""
        return self._layout.log_dir(device_uuid, uid)

    # -- public API

    def start(self) -> AdoptionReport:
        """Adopt live daemons found under the runtime directory; clean up stale ones.

        Call once at migd start-up, before any share. An adopted daemon has no shares
        until the daemon re-registers its leases with :meth:`ensure_share` (idempotent).
        A directory whose daemon is gone, or whose pid file names a process that is not
        an MPS control daemon (PID reuse), loses its pipe directory and record; logs stay.

        Raises:
            MpsError: the runtime directory cannot be created.
        """
        self._layout.make_dir(self.root, 0o755)
        adopted: list[str] = []
        cleaned: list[str] = []
        lost: list[str] = []
        for device_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            record = read_record(device_dir)
            recorded = record.device_uuid if record is not None else None
            pid = read_pid(device_dir / "pipe" / PID_FILE_NAME)
            if record is not None and pid is None:
                pid = record.pid
            if pid is not None and pid_alive(pid) and looks_like_mps_control(pid):
                if record is None:
                    record = record_for_foreign(
                        device_dir, pid, multi_user=self.config.multi_user, now=self._clock.now()
                    )
                    if record is None:
                        continue
                daemon = self._launcher.take_over(record, pid)
                if daemon is not None:
                    with self._registry_lock:
                        self._daemons[record.device_uuid] = daemon
                    write_record(record)
                    adopted.append(record.device_uuid)
                    continue
            if recorded is not None:
                lost.append(recorded)
            remove_stale(device_dir)
            cleaned.append(str(device_dir))
        return AdoptionReport(adopted=tuple(adopted), cleaned=tuple(cleaned), lost=tuple(lost))

    def ensure_share(self, device_uuid: str, share: MpsShare) -> dict[str, str]:
        """Make the device's daemon ready for ``share``; return the job's environment.

        Starts the control daemon on the first share (as the share's user in per-user
        mode), restarts it as another user when an idle per-user device changes hands,
        raises the pinned-memory limits to the largest active share and (optionally)
        starts the server. Idempotent for a share id already active.

        The caller has admitted the share with :func:`migd.core.mps.admit` first.

        Raises:
            MpsError: the daemon could not be started or configured (subclasses say why);
                in per-user mode also when the device still serves another user.
        """
        with self._device_lock(device_uuid):
            daemon = self._daemons.get(device_uuid)
            if daemon is not None and share.share_id in daemon.shares:
                return self._environment(daemon, share)
            if daemon is not None and not pid_alive(daemon.record.pid):
                # Died since the last health check: replace it before adding a share.
                daemon = self._restart(daemon)
            serves_uid = 0 if self.config.multi_user else share.uid
            if daemon is not None and (
                daemon.record.serves_uid != serves_uid
                or daemon.record.multi_user != self.config.multi_user
            ):
                if daemon.shares:
                    raise MpsError(
                        f"MPS device {device_uuid} serves uid {daemon.record.serves_uid} "
                        f"({len(daemon.shares)} share(s)); cannot start uid {share.uid}'s share",
                        hint="per-user MPS serialises users; the request must wait",
                        device_uuid=device_uuid,
                    )
                self._stop(daemon)
                daemon = None
            if daemon is None:
                daemon = self._start_daemon(device_uuid, share)
            daemon.shares[share.share_id] = share
            daemon.idle_since = None
            try:
                servers = apply_limits(self._commands, daemon)
                if self.config.prestart_server:
                    self._ensure_server(daemon, servers)
            except MpsError:
                daemon.shares.pop(share.share_id, None)
                if not daemon.shares:
                    daemon.idle_since = self._clock.monotonic()
                raise
            return self._environment(daemon, share)

    def release_share(self, device_uuid: str, share_id: str) -> None:
        """Forget a share (idempotent). The daemon stays until :meth:`stop_idle`.

        Lowers the limits to the largest remaining share for clients that start later.
        Failures to do so are recorded, not raised: release must not fail.
        """
        with self._device_lock(device_uuid):
            daemon = self._daemons.get(device_uuid)
            if daemon is None or daemon.shares.pop(share_id, None) is None:
                return
            if daemon.shares:
                try:
                    apply_limits(self._commands, daemon)
                except MpsError as exc:
                    daemon.last_error = str(exc)
            else:
                daemon.idle_since = self._clock.monotonic()

    def stop_idle(self) -> list[str]:
        """Stop daemons without shares for ``idle_stop_s``; returns their device UUIDs."""
        stopped = []
        now = self._clock.monotonic()
        for device_uuid in self._known_devices():
            with self._device_lock(device_uuid):
                daemon = self._daemons.get(device_uuid)
                if (
                    daemon is not None
                    and not daemon.shares
                    and daemon.idle_since is not None
                    and now - daemon.idle_since >= self.config.idle_stop_s
                ):
                    self._stop(daemon)
                    stopped.append(device_uuid)
        return stopped

    def stop_device(self, device_uuid: str) -> None:
        """Stop one device's daemon now (e.g. before its MIG instance is destroyed).

        Equivalent of ``echo quit | CUDA_MPS_PIPE_DIRECTORY=<pipe> nvidia-cuda-mps-control``.
        Active shares are dropped with it.
        """
        with self._device_lock(device_uuid):
            daemon = self._daemons.get(device_uuid)
            if daemon is not None:
                self._stop(daemon)

    def watch_servers(self, watcher: Callable[[str, Collection[int]], None]) -> None:
        """Call ``watcher(device_uuid, server_pids)`` whenever this manager starts or finds
        servers on a device.

        The simulated GPU uses it to list each MPS server as a compute process on its
        device, as NVML does (``SimNode.procs.track_mps_servers``). A watcher that raises is
        ignored: it must not break MPS.
        """
        self._server_watchers.append(watcher)

    def _servers_seen(self, daemon: Daemon) -> None:
        for watcher in self._server_watchers:
            with contextlib.suppress(Exception):
                watcher(daemon.record.device_uuid, frozenset(daemon.known_servers))

    def stop_for_teardown(
        self, device_uuid: str, device_pids: Callable[[], Collection[int]]
    ) -> None:
        """Before the MIG instance behind ``device_uuid`` is destroyed: stop its MPS daemon
        and wait, bounded, until its servers have left the device's NVML process list.

        The MPS server is a compute process on its device until it exits (MPS docs,
        "Quick Start": the server is what holds the CUDA context), and it exits a moment
        *after* the control daemon's ``quit`` returns; a destroy in between fails with
        IN_USE or finds "processes" on the instance. ``device_pids`` lists the PIDs NVML
        reports on the device (e.g. ``backend.processes(gpu, mig_uuid)``); it is polled
        until none of the servers is among them, for at most
        ``config.server_exit_timeout_s``. A device without a daemon of this manager
        returns at once.

        Raises:
            MpsDeviceBusy: the server has clients, or the daemon cannot say: never tear
                the device down then.
            MpsServerStillRunning: a server still shows on the device after the timeout.
        """
        with self._device_lock(device_uuid):
            daemon = self._daemons.get(device_uuid)
            if daemon is None:
                return
            servers: set[int] = set(daemon.known_servers)
            if pid_alive(daemon.record.pid):
                try:
                    listed = live_pids(self._commands.command(daemon, "get_server_list"))
                    clients = list(self._commands.clients(daemon, listed))
                except MpsError as exc:
                    raise MpsDeviceBusy(
                        f"the MPS daemon on {device_uuid} does not say whether it has "
                        f"clients ({exc}); not tearing the device down",
                        device_uuid=device_uuid,
                    ) from exc
                if clients:
                    raise MpsDeviceBusy(
                        f"the MPS server on {device_uuid} has {len(clients)} client(s) "
                        f"({', '.join(map(str, sorted(clients)))}); not tearing it down",
                        device_uuid=device_uuid,
                        clients=sorted(clients),
                    )
                servers.update(listed)
            self._stop(daemon)
        self._launcher.wait_servers_gone(device_uuid, servers, device_pids)

    def shutdown(self, keep: Collection[str] = ()) -> None:
        """Stop every daemon this manager started or adopted, and nothing else.

        Args:
            keep: device UUIDs whose daemons stay up because jobs still use them (migd
                restarting under running jobs); the next :meth:`start` adopts them.
        """
        for device_uuid in self._known_devices():
            if device_uuid not in keep:
                self.stop_device(device_uuid)

    def check_health(self) -> HealthReport:
        """Find dead or sick daemons and servers, restart them, report the devices hit.

        Checks, per daemon: its pid is alive; ``get_server_list`` answers in time;
        servers seen before are still alive; control.log/server.log have no new crash
        or ``all CUDA-capable devices are busy or unavailable`` lines. A dead, mute or
        refusing daemon is restarted (killed first if needed); a crashed server is
        started again. Every device in the report lost (or may have lost) its clients.
        """
        events: list[HealthEvent] = []
        for device_uuid in self._known_devices():
            with self._device_lock(device_uuid):
                daemon = self._daemons.get(device_uuid)
                if daemon is not None:
                    events.extend(self._check_one(daemon))
        return HealthReport(events=tuple(events))

    def status(self) -> list[MpsDaemonStatus]:
        """Every managed daemon with its servers, clients and limits (``migctl status``).

        Asks each daemon (``get_server_list``, ``get_client_list``,
        ``get_default_device_pinned_mem_limit``); a daemon that does not answer shows as
        unhealthy with the error.
        """
        result = []
        for device_uuid in self._known_devices():
            with self._device_lock(device_uuid):
                daemon = self._daemons.get(device_uuid)
                if daemon is not None:
                    result.append(status_of(daemon, self._commands, self._clock))
        return result

    def status_for(self, device_uuid: str) -> list[dict[str, Any]]:
        """``status()`` of one device's daemon as JSON-ready dicts (empty if none runs).

        Asks the daemon, so it may block for the command timeouts and for a start or
        quit in progress on the device; :meth:`cached_status_for` never blocks.
        """
        with self._device_lock(device_uuid):
            daemon = self._daemons.get(device_uuid)
            return (
                [] if daemon is None else [status_of(daemon, self._commands, self._clock).to_dict()]
            )

    def refresh_status(self) -> None:
        """Ask every daemon for its status and keep the answers for :meth:`cached_status_for`.

        Slow (commands with timeouts, device locks): run it off the caller's event loop,
        e.g. after :meth:`check_health`.
        """
        fresh: dict[str, tuple[dict[str, Any], float]] = {}
        for device_uuid in self._known_devices():
            with self._device_lock(device_uuid):
                daemon = self._daemons.get(device_uuid)
                if daemon is not None:
                    fresh[device_uuid] = (
                        status_of(daemon, self._commands, self._clock).to_dict(),
                        self._clock.monotonic(),
                    )
        with self._registry_lock:
            self._status_cache = fresh

    def cached_status_for(self, device_uuid: str) -> list[dict[str, Any]]:
        """The device's daemon as last read by :meth:`refresh_status`, without blocking.

        Each entry has ``age_s``: how old the daemon's answers are. A daemon started since
        the last refresh is shown from migd's own record (``age_s`` ``None``; servers and
        clients not read yet).
        """
        with self._registry_lock:
            daemon = self._daemons.get(device_uuid)
            cached = self._status_cache.get(device_uuid)
        if daemon is None:
            return []
        return [cached_status(daemon, cached, self._clock.monotonic())]

    def manages(self, device_uuid: str) -> bool:
        """True if a daemon of this manager serves the device."""
        with self._registry_lock:
            return device_uuid in self._daemons

    def client_count(self, device_uuid: str) -> int:
        """How many client processes the device's servers have now (0 without a daemon).

        Raises:
            MpsError: the daemon did not answer (callers must then assume clients).
        """
        with self._device_lock(device_uuid):
            daemon = self._daemons.get(device_uuid)
            if daemon is None or not pid_alive(daemon.record.pid):
                return 0
            # Only servers that still run: a crashed one may be listed until it is reaped.
            servers = live_pids(self._commands.command(daemon, "get_server_list"))
            return len(list(self._commands.clients(daemon, servers)))

    def report_client_error(self, device_uuid: str, message: str) -> None:
        """A job on the device failed to attach (its stderr had ``message``).

        ``all CUDA-capable devices are busy or unavailable`` from an MPS client means the
        server does not take clients; the next :meth:`check_health` restarts the daemon.
        CUDA error 808's text (the client cap) is counted as a refusal at the cap, with no
        restart. Other messages are kept as the daemon's last error only.
        """
        with self._device_lock(device_uuid):
            daemon = self._daemons.get(device_uuid)
            if daemon is None:
                return
            daemon.last_error = message.strip()
            if "all CUDA-capable devices are busy or unavailable" in message:
                daemon.reported = ("devices_unavailable", f"client reported: {message.strip()}")
            elif CLIENT_CAP_MESSAGE in message:
                daemon.reported = ("client_cap", f"client reported: {message.strip()}")

    # -- for migd.daemon: leases instead of shares

    def share_for(self, lease: Lease) -> MpsShare:
        """The MPS share of a lease: its id, owner, granted (else requested) memory, the
        client processes it declared and its compute share (``mps_thread_percentage``:
        the scheduler's, else the request's)."""
        request = lease.request
        return MpsShare(
            share_id=lease.lease_id,
            uid=lease.owner_uid,
            memory_mib=lease.memory_limit_mib or request.memory_mib,
            clients=request.mps_clients,
            thread_percentage=lease.mps_thread_percentage or request.mps_thread_percentage,
        )

    def client_env(self, device_uuid: str, lease: Lease) -> dict[str, str]:
        """The job environment for ``lease`` on ``device_uuid``, without starting anything.

        The pipe directory depends only on the device, so the scheduler can hand out the
        environment when it grants the lease and :meth:`ensure` can run later.
        """
        return share_environment(
            self.share_for(lease),
            str(self.pipe_dir(device_uuid)),
            device_uuid,
            str(self.log_dir(device_uuid, self.config.serves_uid(lease.owner_uid))),
        )

    # -- internals: daemons

    def _known_devices(self) -> list[str]:
        with self._registry_lock:
            return sorted(self._daemons)

    @contextlib.contextmanager
    def _device_lock(self, device_uuid: str) -> Iterator[None]:
        with self._registry_lock:
            lock = self._device_locks.setdefault(device_uuid, threading.RLock())
        with lock:
            yield

    def _environment(self, daemon: Daemon, share: MpsShare) -> dict[str, str]:
        return share_environment(
            share, daemon.record.pipe_dir, daemon.record.device_uuid, daemon.record.log_dir
        )

    def _start_daemon(self, device_uuid: str, share: MpsShare) -> Daemon:
        daemon = self._launcher.start(device_uuid, share)
        with self._registry_lock:
            self._daemons[device_uuid] = daemon
        return daemon

    def _stop(self, daemon: Daemon) -> None:
        """``quit`` the daemon, kill it if it will not go, remove its pipe dir and record."""
        self._launcher.quit(daemon)
        with self._registry_lock:
            self._daemons.pop(daemon.record.device_uuid, None)
        remove_stale(Path(daemon.record.pipe_dir).parent)

    def _ensure_server(self, daemon: Daemon, servers: list[int] | None = None) -> bool:
        """:func:`.limits.ensure_server`, telling the watchers of a server it started."""
        started = ensure_server(self._commands, daemon, servers)
        if started:
            self._servers_seen(daemon)
        return started

    def _restart(self, daemon: Daemon) -> Daemon:
        """Replace a daemon with a fresh one for the same user, limits and shares."""
        shares = dict(daemon.shares)
        self._launcher.kill(daemon)
        with self._registry_lock:
            self._daemons.pop(daemon.record.device_uuid, None)
        remove_stale(Path(daemon.record.pipe_dir).parent)
        template = next(iter(shares.values()), None) or MpsShare(
            share_id="restart", uid=daemon.record.serves_uid, memory_mib=1
        )
        fresh = self._start_daemon(daemon.record.device_uuid, template)
        fresh.shares = shares
        fresh.idle_since = None if shares else self._clock.monotonic()
        if shares:
            servers = apply_limits(self._commands, fresh)
            if self.config.prestart_server:
                self._ensure_server(fresh, servers)
        return fresh

    # -- internals: health

    def _check_one(self, daemon: Daemon) -> list[HealthEvent]:
        """Check one daemon (:func:`.health.diagnose`) and bring it back: a crashed server
        is started again; a gone, mute or refusing daemon is replaced."""
        uuid = daemon.record.device_uuid
        seen = set(daemon.known_servers)
        found = diagnose(daemon, self._commands)
        if found is None:
            if daemon.known_servers - seen:  # started by the control daemon for a client
                self._servers_seen(daemon)
            daemon.healthy = True
            if daemon.restart_when_drained and self._connected_clients(daemon) == 0:
                # A client was refused while others ran; they are gone now: restart the
                # daemon that may be sick, at no cost to anyone.
                return [
                    self._restart_refusing(
                        daemon,
                        f"drained after a refused client ({daemon.last_error})",
                        clients_lost=False,
                    )
                ]
            return []
        problem, detail = found
        if problem == "server_crashed":
            return [self._recover_server(daemon, detail)]
        if problem == "devices_unavailable":
            return [self._client_refused(daemon, detail)]
        if problem == "client_cap":
            return [self._client_capped(daemon, detail)]
        daemon.healthy, daemon.last_error = False, detail
        try:
            self._restart(daemon)
        except MpsError as exc:
            # Keep the dead daemon registered so the next check tries again.
            daemon.last_error = f"{detail}; restart failed: {exc}"
            with self._registry_lock:
                self._daemons.setdefault(uuid, daemon)
            return [HealthEvent(uuid, problem, daemon.last_error, "restart_failed", False)]
        return [HealthEvent(uuid, problem, detail, "restarted_daemon", True)]

    def _connected_clients(self, daemon: Daemon) -> int | None:
        """Clients connected to the daemon's servers now; ``None``: it cannot say."""
        listed = self._commands.try_command(daemon, "get_server_list")
        if listed is None:
            return None
        total = 0
        for server in live_pids(listed):
            clients = self._commands.try_command(daemon, f"get_client_list {server}")
            if clients is None:
                return None
            total += len(live_pids(clients))
        return total

    def _client_refused(self, daemon: Daemon, detail: str) -> HealthEvent:
        """A client was refused (``all CUDA-capable devices are busy or unavailable``).

        That is what a client past the cap gets (48 on Volta and later, fewer on small MIG
        instances) as much as one of a sick server, and a restart kills every client of the
        device. So: while clients are connected, the refusal costs only the refused client
        (no restart; counted, with the clients connected then, in ``migctl status``), and
        the daemon is restarted once those clients are gone if it still refuses then. With
        no client connected nobody is lost: the daemon is restarted at once if its server
        cannot be started (or it cannot say how many clients it has).
        """
        uuid = daemon.record.device_uuid
        connected = self._connected_clients(daemon)
        daemon.last_error = detail
        if connected:
            daemon.count_refusal(connected)
            daemon.restart_when_drained = True
            daemon.healthy = True
            return HealthEvent(
                uuid,
                "devices_unavailable",
                f"{detail}; {connected} client(s) connected: only the refused client is "
                "affected, the daemon is not restarted while clients run",
                "none",
                True,
                clients_lost=False,
            )
        # Nobody connected (or the daemon cannot say): a server that refuses its only
        # would-be client is sick, and a restart now loses nothing it can know of.
        return self._restart_refusing(daemon, detail, clients_lost=connected is None)

    def _client_capped(self, daemon: Daemon, detail: str) -> HealthEvent:
        """The server turned a client away at its client cap: the device is healthy and
        full, so nothing is restarted. The refusal is counted with the cap (the server's
        log line names it; a client's report does not, then the clients connected now),
        which the scheduler's books take as the device's capacity
        (``MpsSupervisor.apply_client_caps``)."""
        named = CLIENT_CAP_LOG.search(detail)
        connected = int(named.group(1)) if named else self._connected_clients(daemon)
        daemon.last_error = detail
        daemon.count_refusal(connected)
        daemon.healthy = True
        return HealthEvent(
            daemon.record.device_uuid,
            "client_cap",
            f"{detail}: only the refused client is affected",
            "none",
            True,
            clients_lost=False,
        )

    def _restart_refusing(self, daemon: Daemon, detail: str, *, clients_lost: bool) -> HealthEvent:
        uuid = daemon.record.device_uuid
        daemon.healthy, daemon.restart_when_drained = False, False
        try:
            self._restart(daemon)
        except MpsError as exc:
            daemon.last_error = f"{detail}; restart failed: {exc}"
            with self._registry_lock:
                self._daemons.setdefault(uuid, daemon)
            return HealthEvent(
                uuid, "devices_unavailable", daemon.last_error, "restart_failed", False
            )
        return HealthEvent(
            uuid, "devices_unavailable", detail, "restarted_daemon", True, clients_lost=clients_lost
        )

    def _recover_server(self, daemon: Daemon, detail: str) -> HealthEvent:
        uuid = daemon.record.device_uuid
        if not daemon.shares or not self.config.prestart_server:
            # The control daemon starts a server on the next client by itself.
            daemon.healthy = True
            return HealthEvent(uuid, "server_crashed", detail, "none", True)
        try:
            started = self._ensure_server(daemon)
        except MpsError as exc:
            daemon.healthy, daemon.last_error = False, f"{detail}; {exc}"
            return HealthEvent(uuid, "server_crashed", daemon.last_error, "restart_failed", False)
        daemon.healthy = True
        action = "restarted_server" if started else "none"
        return HealthEvent(uuid, "server_crashed", detail, action, True)
