"""Runs NVIDIA MPS control daemons for migd: one per MPS device, started on demand.

An *MPS device* is a whole GPU in MPS mode or one MIG device with MPS on top
(:mod:`migd.core.mps` does the accounting). For each one the manager runs its own
``nvidia-cuda-mps-control -d`` with

* its own ``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY`` under the
  runtime directory (``<runtime>/mps/<uuid>/pipe`` and ``.../log``): "When there
  are multiple instances of the control daemon running in parallel" each is
  addressed through its pipe directory, where it writes
  ``nvidia-cuda-mps-control.pid`` (docs.nvidia.com/deploy/mps, "Appendix: Tools and
  Interface Reference"); the MIG user guide runs one daemon per MIG device the
  same way;
* ``CUDA_VISIBLE_DEVICES=<uuid>`` so the daemon, its server and its clients see
  exactly that device, as device 0;
* ``-M`` in multi-user mode. In per-user mode the daemon runs *as the share's
  user* (NVIDIA's per-user recipe starts it "as $UID",
  docs.nvidia.com/deploy/topics/topic_6_1_2_1.html): only that user's clients can
  reach it, and a job that talks to its daemon can only affect its own user's
  shares. That needs root; without root the manager runs everything as itself
  and records so (tests, development).

After start the manager sets the daemon's default pinned-memory limit
(``set_default_device_pinned_mem_limit <uuid> <N>M``) to the largest limit among
the device's active shares, and the same on each running server
(``set_device_pinned_mem_limit <PID> ...``), because defaults only reach servers
started later and per-server limits only reach new clients (MPS v2 interface
docs). A client that drops ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` from its
environment is then still bounded, by the largest active share rather than its
own (htcondor-mps-nvml.md §4.5); NVML monitoring has to catch the rest. The active
thread percentage is bounded the same way (``set_default_active_thread_percentage`` and
``set_active_thread_percentage <PID>``), as NVIDIA's device plugin and DRA driver do.
Every such command is checked by reading the value back, never by its output.

Commands go to the daemon the documented way, through a front-end invocation
with the same pipe directory: ``echo quit | nvidia-cuda-mps-control``. Every call
has a timeout. Control daemons this manager started are recorded in
``<runtime>/mps/<uuid>/migd-mps.json``; on start-up it adopts the live ones it
finds there and removes stale pipe directories; on shutdown it stops only those.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from migd.core.mps import (
    MPS_CLIENT_DEVICE_INDEX,
    MpsShare,
    UserPolicy,
    format_limit_mib,
    limit_applied,
    parse_limit_mib,
    share_environment,
)
from migd.errors import ConfigError, GpuBusy, MpsError
from migd.paths import ensure_dir
from migd.ports import Clock, SystemClock

if TYPE_CHECKING:
    from migd.core.scheduler import Lease

PID_FILE_NAME = "nvidia-cuda-mps-control.pid"  # written by the daemon into its pipe dir
CONTROL_SOCKET_NAME = "control"  # "Starting control daemon using socket <pipe>/control"
RECORD_FILE_NAME = "migd-mps.json"
CONTROL_LOG_NAME = "control.log"
SERVER_LOG_NAME = "server.log"
# AF_UNIX sun_path holds 108 bytes with the terminator. Past it the daemon cannot bind
# its control socket and the front end only says it cannot find the daemon.
SOCKET_PATH_MAX_BYTES = 107

NO_DAEMON_MESSAGE = "Cannot find MPS control daemon process"
ALREADY_RUNNING_MESSAGE = "An instance of this daemon is already running"

# Lines in control.log/server.log that mean trouble. The first two are the real
# daemon's wording (control logs quoted in NVIDIA/k8s-device-plugin#685: "Server
# encountered a fatal exception. Shutting down", "Server 95 exited with status 1").
# The third is cudaErrorDevicesUnavailable's text, which *clients* print when they
# cannot attach to the server (NVIDIA/k8s-device-plugin#647, #1118); whether the real
# daemon logs it is not verified, so the wrapper should also pass it on from the job's
# stderr (MpsManager.report_client_error).
LOG_PROBLEMS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Server (\d+) exited with status ([1-9]\d*)"), "server_crashed"),
    (re.compile(r"Server encountered a fatal exception"), "server_crashed"),
    (re.compile(r"all CUDA-capable devices are busy or unavailable"), "devices_unavailable"),
)

# A server that ends normally (asked to by `quit`, a user hand-over or shutdown_server)
# logs status 0; its clients were done, so nothing is lost.
SERVER_EXIT_OK = re.compile(r"Server (\d+) exited with status 0\b")

_POLL_S = 0.02


# -- errors -----------------------------------------------------------------------------------


class MpsBinaryNotFound(MpsError):
    """The control program is not installed (or not where the config says)."""

    default_hint = (
        "install the driver's MPS tools (Debian: nvidia-cuda-mps; NVIDIA packages: "
        "nvidia-compute-utils) or set the control binary path in migd.toml [mps]"
    )


class MpsCommandTimeout(MpsError):
    """A front-end command or daemon start ran past its timeout (and was killed)."""

    default_hint = (
        "the MPS control daemon did not answer in time; migd restarts it on the next "
        "health check (`migctl status` shows it)"
    )


class MpsCommandFailed(MpsError):
    """The front end found no daemon, lost the link, or the daemon rejected a command."""

    default_hint = "see the daemon's control.log (path in `migctl status`)"


class MpsDaemonStartFailed(MpsError):
    """``nvidia-cuda-mps-control -d`` failed, or the daemon never answered."""

    default_hint = (
        "see control.log in the device's MPS log directory; check that the GPU/MIG UUID "
        "exists (`nvidia-smi -L`) and that nothing else uses that pipe directory"
    )


class MpsDeviceBusy(MpsError, GpuBusy):
    """An MPS device cannot be torn down now: its server has clients, or cannot say."""

    default_hint = "migd destroys the instance once its MPS clients are gone"


class MpsServerStillRunning(MpsDeviceBusy):
    """The control daemon quit, but its server still shows as an NVML compute process."""

    default_hint = (
        "an MPS server normally exits within seconds of `quit`; see server.log in the "
        "device's MPS log directory. migd tries the teardown again later"
    )


# -- running commands -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunAs:
    """The user a daemon (and the commands sent to it) run as."""

    uid: int
    gid: int


@dataclass(frozen=True, slots=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return (self.stdout + self.stderr).strip()


class CommandRunner(Protocol):
    """Runs one bounded command; the seam tests use to see what would run as whom."""

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdin: str | None,
        timeout_s: float,
        run_as: RunAs | None,
    ) -> CommandResult:
        """Run ``argv`` to completion.

        Raises:
            MpsBinaryNotFound: the program does not exist.
            MpsCommandTimeout: it ran longer than ``timeout_s`` (it is killed).
            MpsError: it could not be started (permissions, resources).
        """
        ...


class SubprocessRunner:
    """:class:`CommandRunner` over :func:`subprocess.run`.

    Output goes to temporary files, not pipes: ``-d`` leaves a daemon behind, and a
    daemon that kept an inherited pipe open would make the caller wait for it.
    ``run_as`` is honoured only when this process is root; otherwise the command runs
    as the current user (the caller records that).
    """

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdin: str | None,
        timeout_s: float,
        run_as: RunAs | None,
    ) -> CommandResult:
        user: dict[str, Any] = {}
        if run_as is not None and os.geteuid() == 0 and run_as.uid != 0:
            user = {"user": run_as.uid, "group": run_as.gid, "extra_groups": []}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.run(
                    list(argv),
                    input=None if stdin is None else stdin.encode(),
                    stdin=subprocess.DEVNULL if stdin is None else None,
                    stdout=out,
                    stderr=err,
                    env=dict(env),
                    timeout=timeout_s,
                    check=False,
                    close_fds=True,
                    **user,
                )
            except FileNotFoundError as exc:
                raise MpsBinaryNotFound(f"{argv[0]} not found", binary=argv[0]) from exc
            except subprocess.TimeoutExpired as exc:
                raise MpsCommandTimeout(
                    f"`{' '.join(argv)}` did not finish within {timeout_s:g} s",
                    argv=list(argv),
                    timeout_s=timeout_s,
                ) from exc
            except OSError as exc:
                raise MpsError(
                    f"cannot run `{' '.join(argv)}`: {exc}",
                    hint="check the binary's permissions and that migd runs as root",
                    argv=list(argv),
                ) from exc
            out.seek(0)
            err.seek(0)
            return CommandResult(
                argv=tuple(argv),
                returncode=proc.returncode,
                stdout=out.read().decode("utf-8", "replace"),
                stderr=err.read().decode("utf-8", "replace"),
            )


# -- configuration and records ----------------------------------------------------------------


@dataclass(frozen=True)
class MpsManagerConfig:
    """``[mps]`` settings.

    Attributes:
        binary: the control program (``nvidia-cuda-mps-control`` on ``PATH``, or a path).
        policy: per-user (daemon runs as the share's user) or multi-user (``-M``).
        idle_stop_s: a daemon without shares is stopped after this long.
        command_timeout_s: limit for each front-end command.
        start_timeout_s: how long a new daemon may take to answer.
        quit_timeout_s: how long ``quit`` may take before the daemon is killed.
        server_exit_timeout_s: how long a device's MPS server may still show as an NVML
            compute process after its daemon quit, before a teardown gives up
            (:meth:`MpsManager.stop_for_teardown`).
        prestart_server: start the server (``start_server -uid``) with the first share,
            so a broken GPU shows up at lease time rather than in the job.
        env: environment for the daemon and commands (``PATH`` from migd by default).
        systemd_scope: start each daemon in its own transient systemd scope
            (``systemd-run --scope``), so it leaves migd's cgroup and survives a restart
            of migd's unit (``KillMode=mixed`` kills what stays in it). ``None``: when
            migd runs under systemd (``INVOCATION_ID`` set) and ``systemd_run`` exists.
        systemd_run: the ``systemd-run`` program.
    """

    binary: str = "nvidia-cuda-mps-control"
    policy: UserPolicy = UserPolicy.PER_USER
    idle_stop_s: float = 300.0
    command_timeout_s: float = 10.0
    start_timeout_s: float = 30.0
    quit_timeout_s: float = 30.0
    server_exit_timeout_s: float = 10.0
    prestart_server: bool = True
    env: Mapping[str, str] | None = None
    systemd_scope: bool | None = None
    systemd_run: str = "systemd-run"


@dataclass
class DaemonRecord:
    """What the manager knows of a control daemon it started (persisted as JSON)."""

    device_uuid: str
    pid: int
    pipe_dir: str
    log_dir: str
    uid: int  # the user the daemon runs as
    gid: int
    serves_uid: int  # the user whose server it runs (0 in multi-user mode)
    multi_user: bool
    started_at: float
    default_limit_mib: int = 0
    # Active thread percentage set on the daemon and its servers (100: the daemon's own
    # default, nothing set).
    thread_percentage: int = 100
    run_as_self: bool = False  # not root: could not switch user, ran as migd's own uid
    scope_unit: str = ""  # the transient systemd scope it runs in ("" when none)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DaemonRecord:
        data = json.loads(text)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


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

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["servers"] = list(self.servers)
        data["clients"] = list(self.clients)
        return data


@dataclass(frozen=True)
class HealthEvent:
    """One problem the health check found and what it did about it."""

    device_uuid: str
    problem: str  # daemon_gone, daemon_unresponsive, server_crashed, devices_unavailable
    detail: str
    action: str  # restarted_daemon, restarted_server, restart_failed, none
    ok: bool  # the device serves again

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class HealthReport:
    events: tuple[HealthEvent, ...] = ()

    @property
    def affected_devices(self) -> tuple[str, ...]:
        """Devices whose clients were (or may have been) lost: their leases need a look."""
        return tuple(dict.fromkeys(e.device_uuid for e in self.events))

    @property
    def failed_devices(self) -> tuple[str, ...]:
        """Devices that could not be brought back: mark them unavailable."""
        return tuple(dict.fromkeys(e.device_uuid for e in self.events if not e.ok))


@dataclass(frozen=True)
class AdoptionReport:
    adopted: tuple[str, ...] = ()  # device UUIDs whose live daemon was taken over
    cleaned: tuple[str, ...] = ()  # directories removed (no live daemon)
    # Device UUIDs whose recorded daemon (started by an earlier migd) was dead or wedged:
    # the clients of leases on them are gone.
    lost: tuple[str, ...] = ()


@dataclass
class _Daemon:
    record: DaemonRecord
    shares: dict[str, MpsShare] = field(default_factory=dict)
    idle_since: float | None = None
    known_servers: set[int] = field(default_factory=set)
    log_offsets: dict[str, int] = field(default_factory=dict)
    healthy: bool = True
    last_error: str = ""
    reported: tuple[str, str] | None = None  # (problem, detail) from a client's report


# -- the manager ------------------------------------------------------------------------------


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
        self._runner: CommandRunner = runner or SubprocessRunner()
        self._clock: Clock = clock or SystemClock()
        self._daemons: dict[str, _Daemon] = {}
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
        name = re.sub(r"[^A-Za-z0-9._-]", "_", device_uuid)
        if not name or name in {".", ".."}:
            raise MpsError(f"unusable device UUID {device_uuid!r}")
        return name

    def device_dir(self, device_uuid: str) -> Path:
        return self.root / self.dir_name(device_uuid)

    def pipe_dir(self, device_uuid: str) -> Path:
        return self.device_dir(device_uuid) / "pipe"

    def log_dir(self, device_uuid: str, uid: int | None = None) -> Path:
        """The log directory of the daemon that serves ``uid`` on the device.

        Each user gets their own (``log/uid-<N>``): a per-user daemon runs as its user and
        owns its logs, and the next user's daemon must not read the last one's.
        ``uid=None`` is the device's log root.
        """
        root = self.device_dir(device_uuid) / "log"
        return root if uid is None else root / f"uid-{uid}"

    def _serves_uid(self, uid: int) -> int:
        return 0 if self._multi_user else uid

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
        self._make_dir(self.root, 0o755)
        adopted: list[str] = []
        cleaned: list[str] = []
        lost: list[str] = []
        for device_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            record = self._read_record(device_dir)
            recorded = record.device_uuid if record is not None else None
            pid = _read_pid(device_dir / "pipe" / PID_FILE_NAME)
            if record is not None and pid is None:
                pid = record.pid
            if pid is not None and _pid_alive(pid) and _looks_like_mps_control(pid):
                if record is None:
                    record = self._record_for_foreign(device_dir, pid)
                    if record is None:
                        continue
                record.pid = pid
                daemon = _Daemon(record=record, idle_since=self._clock.monotonic())
                answered = self._try_command(daemon, "get_server_list")
                if answered is not None:
                    daemon.known_servers = set(_live_pids(answered))
                    self._skip_old_log(daemon)
                    with self._registry_lock:
                        self._daemons[record.device_uuid] = daemon
                    self._write_record(record)
                    adopted.append(record.device_uuid)
                    continue
                # Alive but mute: ours (it is in our directory) and wedged.
                self._kill_daemon(daemon)
            if recorded is not None:
                lost.append(recorded)
            self._remove_stale(device_dir)
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
            if daemon is not None and not _pid_alive(daemon.record.pid):
                # Died since the last health check: replace it before adding a share.
                daemon = self._restart(daemon)
            serves_uid = 0 if self._multi_user else share.uid
            if daemon is not None and (
                daemon.record.serves_uid != serves_uid
                or daemon.record.multi_user != self._multi_user
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
                servers = self._apply_limits(daemon)
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
                    self._apply_limits(daemon)
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
        device, as NVML does (``SimNode.track_mps_servers``). A watcher that raises is
        ignored: it must not break MPS.
        """
        self._server_watchers.append(watcher)

    def _servers_seen(self, daemon: _Daemon) -> None:
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
            if _pid_alive(daemon.record.pid):
                try:
                    listed = _live_pids(self._command(daemon, "get_server_list"))
                    clients = list(self._clients(daemon, listed))
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
        timeout = self.config.server_exit_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            left = sorted(servers.intersection(device_pids()))
            if not left:
                return
            if time.monotonic() >= deadline:
                raise MpsServerStillRunning(
                    f"MPS server(s) {', '.join(map(str, left))} still run on {device_uuid} "
                    f"{timeout:g} s after its control daemon quit; not destroying the instance",
                    device_uuid=device_uuid,
                    servers=left,
                )
            time.sleep(_POLL_S)

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
                    result.append(self._status_of(daemon))
        return result

    def status_for(self, device_uuid: str) -> list[dict[str, Any]]:
        """``status()`` of one device's daemon as JSON-ready dicts (empty if none runs).

        Asks the daemon, so it may block for the command timeouts and for a start or
        quit in progress on the device; :meth:`cached_status_for` never blocks.
        """
        with self._device_lock(device_uuid):
            daemon = self._daemons.get(device_uuid)
            return [] if daemon is None else [self._status_of(daemon).to_dict()]

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
                        self._status_of(daemon).to_dict(),
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
        if cached is not None and cached[0].get("pid") == daemon.record.pid:
            data = dict(cached[0])
            data["age_s"] = round(max(0.0, self._clock.monotonic() - cached[1]), 3)
        else:
            data = self._recorded_status(daemon).to_dict()
            data["age_s"] = None
        # Shares and health change under migd's own hand: always current.
        data["shares"] = len(daemon.shares)
        data["healthy"] = daemon.healthy and bool(data.get("healthy", True))
        if daemon.last_error:
            data["last_error"] = daemon.last_error
        return [data]

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
            if daemon is None or not _pid_alive(daemon.record.pid):
                return 0
            # Only servers that still run: a crashed one may be listed until it is reaped.
            servers = _live_pids(self._command(daemon, "get_server_list"))
            return len(list(self._clients(daemon, servers)))

    def _clients(self, daemon: _Daemon, servers: Iterable[int]) -> Iterator[int]:
        """The client PIDs of ``servers``, one ``get_client_list`` each, as they are read.

        Raises:
            MpsError: a command failed (the clients read before it have been yielded).
        """
        for server in servers:
            yield from _parse_pids(self._command(daemon, f"get_client_list {server}"))

    def _recorded_status(self, daemon: _Daemon) -> MpsDaemonStatus:
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
        )

    def _status_of(self, daemon: _Daemon) -> MpsDaemonStatus:
        """The daemon as it answers now (every server it lists, live or not)."""
        servers: tuple[int, ...] = ()
        clients: list[int] = []
        limit: int | None = None
        healthy, error = daemon.healthy, daemon.last_error
        try:
            servers = tuple(_parse_pids(self._command(daemon, "get_server_list")))
            clients.extend(self._clients(daemon, servers))
            limit = parse_limit_mib(
                self._command(
                    daemon, f"get_default_device_pinned_mem_limit {MPS_CLIENT_DEVICE_INDEX}"
                )
            )
        except MpsError as exc:
            healthy, error = False, str(exc)
        idle = daemon.idle_since
        return replace(
            self._recorded_status(daemon),
            servers=servers,
            clients=tuple(sorted(clients)),
            default_limit_mib=limit,
            healthy=healthy,
            last_error=error,
            idle_for_s=None if idle is None else self._clock.monotonic() - idle,
        )

    def report_client_error(self, device_uuid: str, message: str) -> None:
        """A job on the device failed to attach (its stderr had ``message``).

        ``all CUDA-capable devices are busy or unavailable`` from an MPS client means the
        server does not take clients; the next :meth:`check_health` restarts the daemon.
        Other messages are kept as the daemon's last error only.
        """
        with self._device_lock(device_uuid):
            daemon = self._daemons.get(device_uuid)
            if daemon is None:
                return
            daemon.last_error = message.strip()
            if "all CUDA-capable devices are busy or unavailable" in message:
                daemon.reported = ("devices_unavailable", f"client reported: {message.strip()}")

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
            str(self.log_dir(device_uuid, self._serves_uid(lease.owner_uid))),
        )

    # -- internals: daemons

    @property
    def _multi_user(self) -> bool:
        return self.config.policy is UserPolicy.MULTI_USER

    def _known_devices(self) -> list[str]:
        with self._registry_lock:
            return sorted(self._daemons)

    @contextlib.contextmanager
    def _device_lock(self, device_uuid: str) -> Iterator[None]:
        with self._registry_lock:
            lock = self._device_locks.setdefault(device_uuid, threading.RLock())
        with lock:
            yield

    def _environment(self, daemon: _Daemon, share: MpsShare) -> dict[str, str]:
        return share_environment(
            share, daemon.record.pipe_dir, daemon.record.device_uuid, daemon.record.log_dir
        )

    def _base_env(self) -> dict[str, str]:
        if self.config.env is not None:
            return dict(self.config.env)
        return {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}

    def _daemon_env(self, record: DaemonRecord) -> dict[str, str]:
        env = self._base_env()
        env["CUDA_MPS_PIPE_DIRECTORY"] = record.pipe_dir
        env["CUDA_MPS_LOG_DIRECTORY"] = record.log_dir
        env["CUDA_VISIBLE_DEVICES"] = record.device_uuid
        return env

    def _run_as_for(self, share: MpsShare) -> tuple[RunAs | None, int, int]:
        """(RunAs or None, uid, gid) the daemon for ``share`` runs as."""
        if os.geteuid() != 0:
            return None, os.geteuid(), os.getegid()
        if self._multi_user:
            return None, 0, 0
        gid = share.gid if share.gid is not None else _primary_gid(share.uid)
        return RunAs(share.uid, gid), share.uid, gid

    @staticmethod
    def _run_as(record: DaemonRecord) -> RunAs | None:
        if record.run_as_self or record.uid == 0:
            return None
        return RunAs(record.uid, record.gid)

    def _start_daemon(self, device_uuid: str, share: MpsShare) -> _Daemon:
        run_as, uid, gid = self._run_as_for(share)
        serves_uid = self._serves_uid(share.uid)
        pipe_dir, log_dir = self.pipe_dir(device_uuid), self.log_dir(device_uuid, serves_uid)
        socket_path = str(pipe_dir / CONTROL_SOCKET_NAME)
        if len(socket_path.encode()) > SOCKET_PATH_MAX_BYTES:
            raise MpsDaemonStartFailed(
                f"MPS control socket path {socket_path} is longer than "
                f"{SOCKET_PATH_MAX_BYTES} bytes",
                hint="use a shorter runtime directory (e.g. /run/migd)",
                device_uuid=device_uuid,
            )
        self._make_dir(self.root, 0o755)
        self._make_dir(self.device_dir(device_uuid), 0o755)
        self._make_dir(log_dir.parent, 0o755)
        # Per-user: only the share's user reaches the daemon. Multi-user: every job user
        # must reach the root daemon's socket. Logs: each user their own directory.
        mode = 0o755 if self._multi_user else 0o700
        self._make_dir(pipe_dir, mode, owner=run_as)
        self._make_dir(log_dir, mode, owner=run_as)
        record = DaemonRecord(
            device_uuid=device_uuid,
            pid=0,
            pipe_dir=str(pipe_dir),
            log_dir=str(log_dir),
            uid=uid,
            gid=gid,
            serves_uid=serves_uid,
            multi_user=self._multi_user,
            started_at=self._clock.now(),
            run_as_self=os.geteuid() != 0,
        )
        daemon = _Daemon(record=record)
        self._skip_old_log(daemon)
        argv = [self.config.binary, "-d"] + (["-M"] if self._multi_user else [])
        # (argv, unit) of the systemd scope to start it in; None: start it plainly.
        scope = self._scope(device_uuid, argv, run_as) if self._use_systemd_scope() else None
        attempts = 0
        while True:
            attempts += 1
            launch, launch_as = (scope[0], None) if scope is not None else (argv, run_as)
            result = self._runner.run(
                launch,
                env=self._daemon_env(record),
                stdin=None,
                timeout_s=self.config.start_timeout_s,
                run_as=launch_as,
            )
            if result.returncode == 0:
                record.scope_unit = scope[1] if scope is not None else ""
                break
            orphan = _read_pid(pipe_dir / PID_FILE_NAME)
            if (
                attempts == 1
                and ALREADY_RUNNING_MESSAGE in result.output
                and orphan is not None
                and _pid_alive(orphan)
            ):
                # A daemon in *our* pipe directory that we lost track of (a start that
                # timed out earlier): it is ours, and in the way.
                record.pid = orphan
                self._kill_daemon(daemon)
                continue
            if scope is not None:
                # systemd-run itself failed (no D-Bus, a policy): start it the plain way;
                # it then shares migd's cgroup and does not outlive a unit restart.
                daemon.last_error = (
                    f"could not start the MPS daemon in a systemd scope "
                    f"({result.output or f'exit {result.returncode}'}); started it plainly"
                )
                scope = None
                continue
            raise MpsDaemonStartFailed(
                f"`{' '.join(argv)}` for {device_uuid} failed (exit {result.returncode}): "
                f"{result.output or 'no output'}",
                device_uuid=device_uuid,
                pipe_dir=record.pipe_dir,
            )
        try:
            record.pid = self._wait_ready(daemon)
        except MpsDaemonStartFailed:
            # Do not leave a half-started daemon behind to block the next attempt.
            started = _read_pid(pipe_dir / PID_FILE_NAME)
            if started is not None:
                record.pid = started
                self._kill_daemon(daemon)
            raise
        self._write_record(record)
        with self._registry_lock:
            self._daemons[device_uuid] = daemon
        return daemon

    def _use_systemd_scope(self) -> bool:
        if self.config.systemd_scope is not None:
            return self.config.systemd_scope
        return bool(os.environ.get("INVOCATION_ID")) and (
            shutil.which(self.config.systemd_run, path=self._base_env().get("PATH")) is not None
        )

    def _scope(
        self, device_uuid: str, argv: list[str], run_as: RunAs | None
    ) -> tuple[list[str], str]:
        """``systemd-run --scope ... -- <argv>`` and the unit: the daemon in its own scope.

        A scope takes the process that systemd-run becomes (it execs the command) and
        everything it forks; the daemon stays in it after the front process exits, out
        of migd's cgroup. ``--collect`` unloads the unit once it is empty, even if it
        failed; the random suffix keeps a unit that is still winding down from blocking
        the name. systemd-run switches to the daemon's user itself (``--uid``/``--gid``).
        """
        short = re.sub(r"[^A-Za-z0-9]", "", self.dir_name(device_uuid).split("-", 1)[-1])[:8]
        kind = "mig" if device_uuid.startswith("MIG-") else "gpu"
        unit = f"migd-mps-{kind}-{short or 'dev'}-{secrets.token_hex(3)}"
        scoped = [self.config.systemd_run, "--scope", "--collect", "--quiet", f"--unit={unit}"]
        if run_as is not None:
            scoped += [f"--uid={run_as.uid}", f"--gid={run_as.gid}"]
        return [*scoped, "--", *argv], unit

    def _wait_ready(self, daemon: _Daemon) -> int:
        """Poll until the pid file names a live process and the daemon answers."""
        record = daemon.record
        pid_file = Path(record.pipe_dir) / PID_FILE_NAME
        deadline = time.monotonic() + self.config.start_timeout_s
        last = "no pid file"
        while time.monotonic() < deadline:
            pid = _read_pid(pid_file)
            if pid is not None and _pid_alive(pid):
                record.pid = pid
                answered = self._try_command(daemon, "get_server_list")
                if answered is not None:
                    daemon.known_servers = set(_parse_pids(answered))
                    return pid
                last = daemon.last_error
            time.sleep(_POLL_S)
        raise MpsDaemonStartFailed(
            f"MPS control daemon for {record.device_uuid} did not come up within "
            f"{self.config.start_timeout_s:g} s ({last})",
            device_uuid=record.device_uuid,
            log_dir=record.log_dir,
        )

    def _apply_limits(self, daemon: _Daemon) -> list[int] | None:
        """Limits on the daemon and each running server := the largest active share's.

        * Pinned memory: the largest share's per-client limit.
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
        target = max((s.memory_mib for s in daemon.shares.values()), default=0)
        threads = max((s.thread_percentage or 100 for s in daemon.shares.values()), default=100)
        memory_changes = target > 0 and target != record.default_limit_mib
        threads_change = bool(daemon.shares) and threads != record.thread_percentage
        if not memory_changes and not threads_change:
            return None
        # By index, not UUID: the daemon sees one device (CUDA_VISIBLE_DEVICES), index 0,
        # and limits set by UUID were seen not to apply (NVIDIA/k8s-device-plugin#572).
        dev = MPS_CLIENT_DEVICE_INDEX
        # Default first, then list: a server that starts in between already has it.
        if memory_changes:
            self._set_checked(
                daemon,
                f"set_default_device_pinned_mem_limit {dev} {format_limit_mib(target)}",
                f"get_default_device_pinned_mem_limit {dev}",
                lambda read: limit_applied(read, target),
            )
        if threads_change:
            self._set_checked(
                daemon,
                f"set_default_active_thread_percentage {threads}",
                "get_default_active_thread_percentage",
                lambda read: _percentage_is(read, threads),
            )
        servers = _live_pids(self._command(daemon, "get_server_list"))
        for pid in servers:
            if memory_changes:
                self._set_checked(
                    daemon,
                    f"set_device_pinned_mem_limit {pid} {dev} {format_limit_mib(target)}",
                    f"get_device_pinned_mem_limit {pid} {dev}",
                    lambda read: limit_applied(read, target),
                    server=pid,
                )
            if threads_change:
                self._set_checked(
                    daemon,
                    f"set_active_thread_percentage {pid} {threads}",
                    f"get_active_thread_percentage {pid}",
                    lambda read: _percentage_is(read, threads),
                    server=pid,
                )
        if memory_changes:
            record.default_limit_mib = target
        record.thread_percentage = threads
        self._write_record(record)
        return servers

    def _set_checked(
        self,
        daemon: _Daemon,
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
        output = self._command(daemon, command)
        if server is not None and not _pid_alive(server):
            return
        read = self._command(daemon, query)
        if not applied(read):
            raise self._not_applied(daemon, [command], output, read)

    @staticmethod
    def _not_applied(
        daemon: _Daemon, commands: list[str], output: str, read_back: str
    ) -> MpsCommandFailed:
        said = " ".join(output.split()) or "no output"
        return MpsCommandFailed(
            f"MPS command(s) {'; '.join(commands)} for {daemon.record.device_uuid} did not "
            f"take effect (the daemon said: {said}; reading it back gave "
            f"{read_back.strip() or 'nothing'!r})",
            device_uuid=daemon.record.device_uuid,
            commands=commands,
        )

    def _ensure_server(self, daemon: _Daemon, servers: list[int] | None = None) -> bool:
        """Start the daemon's server unless one runs; True if it had to start one.

        Whether ``start_server`` worked is read from ``get_server_list`` afterwards, not
        from its output (which may be informational).
        """
        if servers is None:
            servers = _live_pids(self._command(daemon, "get_server_list"))
        started = not servers
        output = ""
        if started:
            output = self._command(daemon, f"start_server -uid {daemon.record.serves_uid}")
            servers = _live_pids(self._command(daemon, "get_server_list"))
        if not servers:
            raise MpsCommandFailed(
                f"MPS server for uid {daemon.record.serves_uid} on "
                f"{daemon.record.device_uuid} did not start"
                + (f": {' '.join(output.split())}" if output.strip() else ""),
                device_uuid=daemon.record.device_uuid,
                log_dir=daemon.record.log_dir,
            )
        daemon.known_servers = set(servers)
        if started:
            self._servers_seen(daemon)
        return started

    def _stop(self, daemon: _Daemon) -> None:
        """``quit`` the daemon, kill it if it will not go, remove its pipe dir and record."""
        record = daemon.record
        quit_ok = False
        if _pid_alive(record.pid):
            with contextlib.suppress(MpsError):
                result = self._runner.run(
                    [self.config.binary],
                    env=self._daemon_env(record),
                    stdin="quit\n",
                    timeout_s=self.config.quit_timeout_s,
                    run_as=self._run_as(record),
                )
                quit_ok = result.returncode == 0
            if quit_ok:
                quit_ok = _wait_gone(record.pid, self.config.quit_timeout_s)
            if not quit_ok:
                self._kill_daemon(daemon)
        with self._registry_lock:
            self._daemons.pop(record.device_uuid, None)
        self._remove_stale(Path(record.pipe_dir).parent)

    def _kill_daemon(self, daemon: _Daemon) -> None:
        """SIGTERM, then SIGKILL, the control daemon and the servers it was last seen with."""
        pids = [daemon.record.pid, *sorted(daemon.known_servers)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                if pid > 0 and _pid_alive(pid) and _looks_like_mps(pid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, sig)
            if all(_wait_gone(pid, 2.0) for pid in pids if pid > 0):
                return

    def _restart(self, daemon: _Daemon) -> _Daemon:
        """Replace a daemon with a fresh one for the same user, limits and shares."""
        shares = dict(daemon.shares)
        self._kill_daemon(daemon)
        with self._registry_lock:
            self._daemons.pop(daemon.record.device_uuid, None)
        self._remove_stale(Path(daemon.record.pipe_dir).parent)
        template = next(iter(shares.values()), None) or MpsShare(
            share_id="restart", uid=daemon.record.serves_uid, memory_mib=1
        )
        fresh = self._start_daemon(daemon.record.device_uuid, template)
        fresh.shares = shares
        fresh.idle_since = None if shares else self._clock.monotonic()
        if shares:
            servers = self._apply_limits(fresh)
            if self.config.prestart_server:
                self._ensure_server(fresh, servers)
        return fresh

    # -- internals: health

    def _check_one(self, daemon: _Daemon) -> list[HealthEvent]:
        uuid = daemon.record.device_uuid
        problem, detail = "", ""
        if not _pid_alive(daemon.record.pid):
            problem, detail = "daemon_gone", f"control daemon {daemon.record.pid} is gone"
        else:
            answered = self._try_command(daemon, "get_server_list")
            if answered is None:
                problem, detail = "daemon_unresponsive", daemon.last_error
            else:
                servers = set(_live_pids(answered))
                scanned, exited_ok = self._scan_logs(daemon)
                # A server that logged a normal exit had no clients left: not a crash.
                lost = sorted(
                    p for p in daemon.known_servers if p not in servers and p not in exited_ok
                )
                log_problem = daemon.reported or scanned
                daemon.reported = None
                if log_problem is not None and log_problem[0] == "devices_unavailable":
                    problem, detail = log_problem
                elif lost or log_problem is not None:
                    problem = "server_crashed"
                    detail = (
                        log_problem[1]
                        if log_problem is not None
                        else f"MPS server(s) {', '.join(map(str, lost))} exited"
                    )
                    daemon.known_servers = servers
                    return [self._recover_server(daemon, detail)]
                new_servers = servers - daemon.known_servers
                daemon.known_servers = servers
                if new_servers:  # started by the control daemon for a client
                    self._servers_seen(daemon)
        if not problem:
            daemon.healthy = True
            return []
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

    def _recover_server(self, daemon: _Daemon, detail: str) -> HealthEvent:
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

    def _log_files(self, daemon: _Daemon) -> list[Path]:
        log_dir = Path(daemon.record.log_dir)
        return [log_dir / CONTROL_LOG_NAME, log_dir / SERVER_LOG_NAME]

    def _skip_old_log(self, daemon: _Daemon) -> None:
        for path in self._log_files(daemon):
            with contextlib.suppress(OSError):
                daemon.log_offsets[str(path)] = path.stat().st_size

    def _scan_logs(self, daemon: _Daemon) -> tuple[tuple[str, str] | None, set[int]]:
        """The worst new problem line in the daemon's logs since the last scan, and the
        servers that logged a normal exit (status 0)."""
        found: tuple[str, str] | None = None
        exited_ok: set[int] = set()
        for path in self._log_files(daemon):
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
                    # A refusing device outranks a crashed server: it needs a restart.
                    if pattern.search(line) and (found is None or kind == "devices_unavailable"):
                        found = (kind, line.strip())
        return found, exited_ok

    # -- internals: commands

    def _command(self, daemon: _Daemon, command: str) -> str:
        """Send one command (or several, one a line) through the front end; return stdout.

        Raises:
            MpsCommandTimeout, MpsBinaryNotFound: see :class:`SubprocessRunner`.
            MpsCommandFailed: non-zero exit: no daemon, or the link to it broke.
        """
        record = daemon.record
        result = self._runner.run(
            [self.config.binary],
            env=self._daemon_env(record),
            stdin=command + "\n",
            timeout_s=self.config.command_timeout_s,
            run_as=self._run_as(record),
        )
        if result.returncode != 0 or NO_DAEMON_MESSAGE in result.output:
            raise MpsCommandFailed(
                f"MPS command `{command}` for {record.device_uuid} failed "
                f"(exit {result.returncode}): {result.output or 'no output'}",
                device_uuid=record.device_uuid,
                command=command,
            )
        return result.stdout

    def _try_command(self, daemon: _Daemon, command: str) -> str | None:
        try:
            return self._command(daemon, command)
        except MpsError as exc:
            daemon.last_error = str(exc)
            return None

    # -- internals: files

    def _make_dir(self, path: Path, mode: int, owner: RunAs | None = None) -> None:
        # Through migd.paths: the runtime directory is checked like the socket's,
        # and nothing under it is followed if it is a symlink (a user's `mps -> /root`
        # must not make migd chmod /root). Only the directory is chowned: log directories
        # are per user, so nothing in them belongs to anybody else.
        base = self.root.parent
        try:
            ensure_dir(
                base,
                path.relative_to(base),
                mode,
                owner=(owner.uid, owner.gid) if owner is not None else None,
            )
        except ConfigError as exc:
            raise MpsError(
                f"unsafe MPS directory {path}: {exc.message}", hint=exc.hint, where=exc.where
            ) from exc
        except (OSError, ValueError) as exc:
            raise MpsError(
                f"cannot prepare MPS directory {path}: {exc}",
                hint="migd needs to own its runtime directory (run it as root)",
            ) from exc

    def _write_record(self, record: DaemonRecord) -> None:
        path = Path(record.pipe_dir).parent / RECORD_FILE_NAME
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(record.to_json(), encoding="utf-8")
            tmp.replace(path)
        except OSError as exc:
            raise MpsError(f"cannot write {path}: {exc}") from exc

    @staticmethod
    def _read_record(device_dir: Path) -> DaemonRecord | None:
        try:
            return DaemonRecord.from_json((device_dir / RECORD_FILE_NAME).read_text("utf-8"))
        except (OSError, ValueError, TypeError):
            return None

    def _record_for_foreign(self, device_dir: Path, pid: int) -> DaemonRecord | None:
        """A record for a live daemon found in our directory without one (record lost)."""
        try:
            stat = Path(f"/proc/{pid}").stat()
        except OSError:
            return None
        uuid = _daemon_visible_devices(pid) or device_dir.name
        return DaemonRecord(
            device_uuid=uuid,
            pid=pid,
            pipe_dir=str(device_dir / "pipe"),
            log_dir=_daemon_env_value(pid, "CUDA_MPS_LOG_DIRECTORY") or str(device_dir / "log"),
            uid=stat.st_uid,
            gid=stat.st_gid,
            serves_uid=stat.st_uid,
            multi_user=self._multi_user,
            started_at=self._clock.now(),
            run_as_self=os.geteuid() != 0,
        )

    @staticmethod
    def _remove_stale(device_dir: Path) -> None:
        """Drop a device's pipe directory and record; keep its logs for post-mortems."""
        shutil.rmtree(device_dir / "pipe", ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (device_dir / RECORD_FILE_NAME).unlink()


# -- process helpers ----------------------------------------------------------------------------


def _parse_pids(text: str) -> list[int]:
    return [int(word) for word in text.split() if word.isdigit()]


def _live_pids(text: str) -> list[int]:
    """PIDs from a server list that still run (a crashed server may be listed until reaped)."""
    return [pid for pid in _parse_pids(text) if _pid_alive(pid)]


def _percentage_is(text: str, wanted: int) -> bool:
    """``get_*active_thread_percentage`` prints a float (``50.0``)."""
    try:
        return abs(float(text.strip()) - wanted) < 0.5
    except ValueError:
        return False


def _read_pid(path: Path) -> int | None:
    try:
        text = path.read_text("utf-8").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _pid_alive(pid: int) -> bool:
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


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, UnicodeDecodeError):
        return ""


def _looks_like_mps_control(pid: int) -> bool:
    """Guards against a reused PID in a stale pid file (the fake's module name counts).

    An empty or unreadable command line (a kernel thread, a zombie, a process gone in
    between) is *not* an MPS daemon: it is never adopted, signalled or counted as ours.
    """
    cmdline = _cmdline(pid)
    return "mps-control" in cmdline or "mps_control" in cmdline


def _looks_like_mps(pid: int) -> bool:
    """An MPS control daemon or server (``nvidia-cuda-mps-server``; the fake's servers
    are forks of its control process). Empty command lines do not count."""
    return "mps" in _cmdline(pid)


def _daemon_env_value(pid: int, name: str) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = name.encode() + b"="
    for item in environ:
        if item.startswith(prefix):
            return item.split(b"=", 1)[1].decode() or None
    return None


def _daemon_visible_devices(pid: int) -> str | None:
    return _daemon_env_value(pid, "CUDA_VISIBLE_DEVICES")


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _primary_gid(uid: int) -> int:
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return uid
