"""Starting and stopping one MPS control daemon: directories, ``-d`` (in a systemd
scope when migd runs under systemd), waiting until it answers, ``quit``, and killing
one that will not go.

:class:`DaemonLauncher` knows nothing of shares or of the other devices: the manager
decides when a daemon starts or stops and keeps the registry.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import time
from collections.abc import Callable, Collection
from pathlib import Path

from migd.core.mps import MpsShare
from migd.errors import MpsError
from migd.ports import Clock

from .commands import DaemonCommands
from .config import MpsManagerConfig
from .errors import MpsDaemonStartFailed, MpsServerStillRunning
from .health import skip_old_log
from .procs import (
    POLL_S,
    live_pids,
    looks_like_mps,
    parse_pids,
    pid_alive,
    primary_gid,
    read_pid,
    wait_gone,
)
from .records import (
    CONTROL_SOCKET_NAME,
    PID_FILE_NAME,
    SOCKET_PATH_MAX_BYTES,
    Daemon,
    DaemonRecord,
    MpsLayout,
    write_record,
)
from .runner import RunAs

ALREADY_RUNNING_MESSAGE = "An instance of this daemon is already running"


class DaemonLauncher:
    """Starts, quits and kills control daemons under ``layout`` as ``config`` says."""

    def __init__(
        self, config: MpsManagerConfig, cmds: DaemonCommands, layout: MpsLayout, clock: Clock
    ) -> None:
        self.config = config
        self.cmds = cmds
        self.layout = layout
        self.clock = clock

    def run_as_for(self, share: MpsShare) -> tuple[RunAs | None, int, int]:
        """(RunAs or None, uid, gid) the daemon for ``share`` runs as."""
        if os.geteuid() != 0:
            return None, os.geteuid(), os.getegid()
        if self.config.multi_user:
            return None, 0, 0
        gid = share.gid if share.gid is not None else primary_gid(share.uid)
        return RunAs(share.uid, gid), share.uid, gid

    def start(self, device_uuid: str, share: MpsShare) -> Daemon:
        """Start the device's control daemon for ``share``'s user and wait until it answers.

        Writes its record; the caller registers it. A daemon of ours left in the pipe
        directory (a start that timed out earlier) is killed first; a failed systemd
        scope falls back to a plain start (noted as the daemon's last error).

        Raises:
            MpsDaemonStartFailed: ``-d`` failed or the daemon never answered.
            MpsError: the directories could not be prepared, or the command not run.
        """
        run_as, uid, gid = self.run_as_for(share)
        serves_uid = self.config.serves_uid(share.uid)
        pipe_dir = self.layout.pipe_dir(device_uuid)
        log_dir = self.layout.log_dir(device_uuid, serves_uid)
        socket_path = str(pipe_dir / CONTROL_SOCKET_NAME)
        if len(socket_path.encode()) > SOCKET_PATH_MAX_BYTES:
            raise MpsDaemonStartFailed(
                f"MPS control socket path {socket_path} is longer than "
                f"{SOCKET_PATH_MAX_BYTES} bytes",
                hint="use a shorter runtime directory (e.g. /run/migd)",
                device_uuid=device_uuid,
            )
        self.layout.make_dir(self.layout.root, 0o755)
        self.layout.make_dir(self.layout.device_dir(device_uuid), 0o755)
        self.layout.make_dir(log_dir.parent, 0o755)
        # Per-user: only the share's user reaches the daemon. Multi-user: every job user
        # must reach the root daemon's socket. Logs: each user their own directory.
        mode = 0o755 if self.config.multi_user else 0o700
        self.layout.make_dir(pipe_dir, mode, owner=run_as)
        self.layout.make_dir(log_dir, mode, owner=run_as)
        record = DaemonRecord(
            device_uuid=device_uuid,
            pid=0,
            pipe_dir=str(pipe_dir),
            log_dir=str(log_dir),
            uid=uid,
            gid=gid,
            serves_uid=serves_uid,
            multi_user=self.config.multi_user,
            started_at=self.clock.now(),
            run_as_self=os.geteuid() != 0,
        )
        daemon = Daemon(record=record)
        skip_old_log(daemon)
        argv = [self.config.binary, "-d"] + (["-M"] if self.config.multi_user else [])
        # (argv, unit) of the systemd scope to start it in; None: start it plainly.
        scope = self.scope(device_uuid, argv, run_as) if self.use_systemd_scope() else None
        attempts = 0
        while True:
            attempts += 1
            launch, launch_as = (scope[0], None) if scope is not None else (argv, run_as)
            result = self.cmds.runner.run(
                launch,
                env=self.cmds.daemon_env(record),
                stdin=None,
                timeout_s=self.config.start_timeout_s,
                run_as=launch_as,
            )
            if result.returncode == 0:
                record.scope_unit = scope[1] if scope is not None else ""
                break
            orphan = read_pid(pipe_dir / PID_FILE_NAME)
            if (
                attempts == 1
                and ALREADY_RUNNING_MESSAGE in result.output
                and orphan is not None
                and pid_alive(orphan)
            ):
                # A daemon in *our* pipe directory that we lost track of (a start that
                # timed out earlier): it is ours, and in the way.
                record.pid = orphan
                self.kill(daemon)
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
            record.pid = self.wait_ready(daemon)
        except MpsDaemonStartFailed:
            # Do not leave a half-started daemon behind to block the next attempt.
            started = read_pid(pipe_dir / PID_FILE_NAME)
            if started is not None:
                record.pid = started
                self.kill(daemon)
            raise
        write_record(record)
        return daemon

    def use_systemd_scope(self) -> bool:
        if self.config.systemd_scope is not None:
            return self.config.systemd_scope
        return bool(os.environ.get("INVOCATION_ID")) and (
            shutil.which(self.config.systemd_run, path=self.cmds.base_env().get("PATH")) is not None
        )

    def scope(
        self, device_uuid: str, argv: list[str], run_as: RunAs | None
    ) -> tuple[list[str], str]:
        """``systemd-run --scope ... -- <argv>`` and the unit: the daemon in its own scope.

        A scope takes the process that systemd-run becomes (it execs the command) and
        everything it forks; the daemon stays in it after the front process exits, out
        of migd's cgroup. ``--collect`` unloads the unit once it is empty, even if it
        failed; the random suffix keeps a unit that is still winding down from blocking
        the name. systemd-run switches to the daemon's user itself (``--uid``/``--gid``).
        """
        short = re.sub(r"[^A-Za-z0-9]", "", self.layout.dir_name(device_uuid).split("-", 1)[-1])[:8]
        kind = "mig" if device_uuid.startswith("MIG-") else "gpu"
        unit = f"migd-mps-{kind}-{short or 'dev'}-{secrets.token_hex(3)}"
        scoped = [self.config.systemd_run, "--scope", "--collect", "--quiet", f"--unit={unit}"]
        if run_as is not None:
            scoped += [f"--uid={run_as.uid}", f"--gid={run_as.gid}"]
        return [*scoped, "--", *argv], unit

    def wait_ready(self, daemon: Daemon) -> int:
        """Poll until the pid file names a live process and the daemon answers."""
        record = daemon.record
        pid_file = Path(record.pipe_dir) / PID_FILE_NAME
        deadline = time.monotonic() + self.config.start_timeout_s
        last = "no pid file"
        while time.monotonic() < deadline:
            pid = read_pid(pid_file)
            if pid is not None and pid_alive(pid):
                record.pid = pid
                answered = self.cmds.try_command(daemon, "get_server_list")
                if answered is not None:
                    daemon.known_servers = set(parse_pids(answered))
                    return pid
                last = daemon.last_error
            time.sleep(POLL_S)
        raise MpsDaemonStartFailed(
            f"MPS control daemon for {record.device_uuid} did not come up within "
            f"{self.config.start_timeout_s:g} s ({last})",
            device_uuid=record.device_uuid,
            log_dir=record.log_dir,
        )

    def quit(self, daemon: Daemon) -> None:
        """``quit`` the daemon; kill it if it will not go."""
        record = daemon.record
        quit_ok = False
        if pid_alive(record.pid):
            with contextlib.suppress(MpsError):
                result = self.cmds.runner.run(
                    [self.config.binary],
                    env=self.cmds.daemon_env(record),
                    stdin="quit\n",
                    timeout_s=self.config.quit_timeout_s,
                    run_as=self.cmds.run_as(record),
                )
                quit_ok = result.returncode == 0
            if quit_ok:
                quit_ok = wait_gone(record.pid, self.config.quit_timeout_s)
            if not quit_ok:
                self.kill(daemon)

    def kill(self, daemon: Daemon) -> None:
        """SIGTERM, then SIGKILL, the control daemon and the servers it was last seen with."""
        pids = [daemon.record.pid, *sorted(daemon.known_servers)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                if pid > 0 and pid_alive(pid) and looks_like_mps(pid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, sig)
            if all(wait_gone(pid, 2.0) for pid in pids if pid > 0):
                return

    def wait_servers_gone(
        self, device_uuid: str, servers: Collection[int], device_pids: Callable[[], Collection[int]]
    ) -> None:
        """Wait until none of ``servers`` is among ``device_pids()`` (the device's NVML
        compute processes), for at most ``config.server_exit_timeout_s``: a server exits
        a moment after its daemon's ``quit`` returns.

        Raises:
            MpsServerStillRunning: a server still shows on the device after the timeout.
        """
        timeout = self.config.server_exit_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            left = sorted(set(servers).intersection(device_pids()))
            if not left:
                return
            if time.monotonic() >= deadline:
                raise MpsServerStillRunning(
                    f"MPS server(s) {', '.join(map(str, left))} still run on {device_uuid} "
                    f"{timeout:g} s after its control daemon quit; not destroying the instance",
                    device_uuid=device_uuid,
                    servers=left,
                )
            time.sleep(POLL_S)

    def take_over(self, record: DaemonRecord, pid: int) -> Daemon | None:
        """The live control daemon ``pid`` found in our directory, if it answers.

        One that does not is ours (it is in our directory) and wedged: it is killed and
        ``None`` returned. The logs written before are not news to the health check.
        """
        record.pid = pid
        daemon = Daemon(record=record, idle_since=self.clock.monotonic())
        answered = self.cmds.try_command(daemon, "get_server_list")
        if answered is None:
            self.kill(daemon)
            return None
        daemon.known_servers = set(live_pids(answered))
        skip_old_log(daemon)
        return daemon
