"""A stand-in ``nvidia-cuda-mps-control`` for tests without a GPU.

Run as ``python -m migd.backends.simulated.mps_control [-d | -f] [-M]``; tests put an
executable shim named ``nvidia-cuda-mps-control`` on ``PATH``
(:func:`write_fake_mps_control`). It behaves like the real program as far as
migd relies on it:

* ``-d`` daemonizes, writes ``nvidia-cuda-mps-control.pid`` into
  ``$CUDA_MPS_PIPE_DIRECTORY`` (the file name the MPS docs give, "Appendix: Tools
  and Interface Reference"), listens on the ``control`` socket there (the real
  daemon logs "Starting control daemon using socket <pipe>/control"), and logs to
  ``$CUDA_MPS_LOG_DIRECTORY/control.log`` in the real line format
  (``[YYYY-MM-DD HH:MM:SS.mmm Control  PID] message``, as in the control logs
  quoted in NVIDIA/k8s-device-plugin#685, #1614). A second ``-d`` on the same pipe
  directory prints ``An instance of this daemon is already running`` and exits 1
  (the message scripts test for, e.g. in third-party MPS launchers); stale pid
  and socket files of a dead daemon do not block a new one. ``-f`` runs in the
  foreground; ``-M`` is multi-user mode (every client is served by one root
  server).
* Without ``-d``/``-f`` it is the front end: reads commands from stdin until EOF,
  one per line, sends each to the daemon and prints the reply on stdout. If no
  daemon answers it prints ``Cannot find MPS control daemon process`` and exits 1;
  "the exit status of the front-end UI is zero if communication with the daemon
  is successful. A non-zero value is returned if the daemon is not found or
  connection to the daemon is broken unexpectedly" (``nvidia-cuda-mps-control(1)``).
* Commands (MPS v2 interface, docs.nvidia.com/deploy/mps/latest/mpsv2-interface.html):
  ``get_server_list`` (one PID a line), ``start_server -uid N``,
  ``shutdown_server PID [-f]``, ``get_client_list PID``,
  ``set_default_device_pinned_mem_limit DEV VALUE`` and ``get_...``,
  ``set_device_pinned_mem_limit PID DEV VALUE`` and ``get_...``,
  ``set_default_active_thread_percentage PCT`` (echoes ``PCT.0``) and ``get_...``
  (``100.0`` by default), ``set_active_thread_percentage PID PCT``, ``quit [-t S]``.
  Defaults apply to servers started *later* only, as on the real daemon; set
  commands print nothing on success, and a set with a malformed limit prints nothing
  either (as a real daemon did); an unknown or otherwise malformed command prints an
  error line (wording made up: the real text is not documented).
* ``quit`` stops taking clients, ends every server without clients at once and
  waits for the others' clients to finish; ``quit -t S`` forces the servers down
  after S seconds. The front end returns once the daemon is gone, so a ``quit``
  with clients attached blocks (``nvidia-cuda-mps-control(1)``: "quit [-t TIMEOUT]",
  the daemon stops accepting new clients while waiting for current servers and
  clients to finish; the wording of the man page is quoted secondarily).
* One server per Linux user at a time (per-user mode): a client or ``start_server``
  of another user is queued while the current server has clients, and served once
  that server has drained and exited ("the control daemon requests the existing
  server to shutdown as soon as all its clients are done. Once the existing server
  has terminated, the control daemon launches a new server", man page).
* MPS servers are real child processes of the daemon (so tests can kill one);
  they exit when the daemon goes away. A server enforces the pinned-memory limit
  on its clients: a client's limit is the server's limit for device 0, lowered
  (never raised) by the client's own ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` ("The
  new limit will only further constrain the limit set by the control daemon",
  docs.nvidia.com/deploy/mps/appendix-environment-variables.html).
  :func:`connect_client` is what a simulated CUDA program (``migd.backends.simulated.cuda_job``)
  calls at CUDA init to learn its limit; clients are real processes, and a client
  whose process has exited leaves its server.

Test-only (clearly not NVIDIA's) commands, prefixed ``fake_``:
``fake_register_client PID UID [LIMIT]`` connects a client process the way CUDA
init would (starting a server for the UID; per-user serialisation; the client cap
from ``$FAKE_MPS_MAX_CLIENTS``, default 48 as on a real H100, refusing with error 808's
text and the server's log line; ``LIMIT`` is the client's
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) and prints the server PID;
``fake_client_limit PID`` prints the client's enforced limit for device 0 in MiB
(empty: none); ``fake_unregister_client PID``; ``fake_status`` prints the daemon's
state as JSON.

Failure modes: create ``<pipe dir>/fake-fault-<name>`` (:func:`fault_path`):

* ``crash-server`` (one-shot): every server logs "Server encountered a fatal
  exception. Shutting down" and exits with status 1.
* ``refuse-clients`` (while present): new clients and ``start_server`` fail with
  ``all CUDA-capable devices are busy or unavailable`` (logged).
* ``die`` (one-shot): the daemon exits at once, leaving its pid file and socket.
* ``hang`` (while present): the daemon stops answering.
* ``chatty`` (while present): ``set_*`` and ``start_server`` commands print an
  informational line before their usual reply. Whether the real daemon prints anything
  on success is not documented (the "prints nothing" belief comes from one tutorial), so
  migd must not take output for a refusal.
* ``ignore-limits`` (while present): pinned-memory ``set_*`` commands are accepted and
  print nothing, but change nothing: a refusal that only a follow-up ``get_*`` shows.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import selectors
import shlex
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from migd.core.mps import parse_limit_mib, parse_pinned_limit_env

PID_FILE_NAME = "nvidia-cuda-mps-control.pid"
CONTROL_SOCKET_NAME = "control"
LOCK_FILE_NAME = "control_lock"
CONTROL_LOG_NAME = "control.log"
SERVER_LOG_NAME = "server.log"

NO_DAEMON_MESSAGE = "Cannot find MPS control daemon process"
ALREADY_RUNNING_MESSAGE = "An instance of this daemon is already running"
DEVICES_UNAVAILABLE_MESSAGE = "all CUDA-capable devices are busy or unavailable"
# A client past the server's cap, as recorded on an H100 (driver 580.159.04,
# tests/data/mps_gpu_check/20261128T022439Z-h100/, step 10: 48 of 50 clients connected):
# its CUDA init failed with error 808 (cudaErrorMpsMaxClientsReached) and this text, and
# the server logged the line below. Not "busy or unavailable", which k8s users saw.
CLIENT_CAP_MESSAGE = "the hardware resources required to create MPS client have been exhausted"
CLIENT_CAP_LOG = "Failed to accept new client. Maximum number of clients ({cap}) reached."

FAULTS = ("crash-server", "refuse-clients", "die", "hang", "chatty", "ignore-limits")
_ONE_SHOT_FAULTS = ("crash-server", "die")
_TICK_S = 0.05
_END = b"\0"  # reply terminator: a reply without it means the daemon broke off


def fault_path(pipe_dir: Path | str, name: str) -> Path:
    """Where a test creates a file to inject fault ``name`` (one of :data:`FAULTS`)."""
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
    return Path(pipe_dir) / f"fake-fault-{name}"


def write_fake_mps_control(bin_dir: Path) -> Path:
    """Create an executable ``bin_dir/nvidia-cuda-mps-control`` that runs this fake.

    The shim pins this interpreter and the directory migd is imported from, so it
    works from any working directory and for any user who can read them.
    """
    bin_dir.mkdir(parents=True, exist_ok=True)
    shim = bin_dir / "nvidia-cuda-mps-control"
    # The directory that holds the ``migd`` package (this file is
    # <root>/migd/backends/simulated/mps_control.py): a venv finds migd without it, but the
    # Debian package's system python3 only through it (/usr/lib/migd).
    package_root = Path(__file__).resolve().parents[3]
    # A per-user MPS daemon runs as the job's user, who may not be able to execute the
    # interpreter migd runs under (a venv below a private home): tests can name another
    # one that only needs the standard library to run this module.
    interpreter = os.environ.get("MIGD_FAKE_MPS_PYTHON") or sys.executable
    shim.write_text(
        "#!/bin/sh\n"
        "# Stand-in for NVIDIA's nvidia-cuda-mps-control (migd.backends.simulated.mps_control)\n"
        f"PYTHONPATH={shlex.quote(str(package_root))}${{PYTHONPATH:+:$PYTHONPATH}} "
        f'exec {shlex.quote(interpreter)} -m migd.backends.simulated.mps_control "$@"\n',
        encoding="utf-8",
    )
    shim.chmod(0o755)
    return shim


# -- daemon -----------------------------------------------------------------------------------


@dataclass
class _Server:
    pid: int
    uid: int
    pinned_limits: dict[str, str]
    thread_percentage: float
    clients: set[int] = field(default_factory=set)
    # client pid -> the pinned limit (MiB, device 0) it got at connect time; None: no limit
    client_limits: dict[int, int | None] = field(default_factory=dict)


class _Daemon:
    def __init__(self, pipe_dir: Path, log_dir: Path, *, multi_user: bool) -> None:
        self.pipe_dir = pipe_dir
        self.log_dir = log_dir
        self.multi_user = multi_user
        self.visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.max_clients = int(os.environ.get("FAKE_MPS_MAX_CLIENTS", "48"))
        self.default_limits: dict[str, str] = {}
        self.default_thread_percentage = 100.0
        self.servers: dict[int, _Server] = {}
        # Per-user: UIDs whose clients (or start_server) wait for the current server to drain.
        self.pending_uids: list[int] = []
        # quit: no new clients; the daemon exits when its servers are gone (or at the deadline).
        self.quitting = False
        self.quit_deadline: float | None = None
        self.quit_waiters: list[socket.socket] = []
        self.running = True
        self.cleaned_up = False
        self.sock: socket.socket | None = None
        self.lock_fd = -1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log: IO[str] = (self.log_dir / CONTROL_LOG_NAME).open("a", encoding="utf-8")

    # logging in the real daemon's format: "[2024-04-29 11:22:10.421 Control    73] ..."
    def log(self, message: str, *, who: str = "Control", pid: int | None = None) -> None:
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        ms = int((now % 1) * 1000)
        line = f"[{stamp}.{ms:03d} {who} {pid or os.getpid():>5}] {message}\n"
        target = self._log
        if who == "Server":
            with (self.log_dir / SERVER_LOG_NAME).open("a", encoding="utf-8") as server_log:
                server_log.write(line)
            return
        target.write(line)
        target.flush()

    def fault(self, name: str) -> bool:
        path = fault_path(self.pipe_dir, name)
        if not path.exists():
            return False
        if name in _ONE_SHOT_FAULTS:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return True

    # -- servers

    def start_server(self, uid: int) -> _Server:
        pid = os.fork()
        if pid == 0:  # the "MPS server": lives until the daemon goes away
            self._become_server()
        server = _Server(
            pid=pid,
            uid=uid,
            pinned_limits=self.server_defaults(),
            thread_percentage=self.default_thread_percentage,
        )
        self.servers[pid] = server
        self.log(f"Starting new server {pid} for user {uid}")
        self.log(f"NEW SERVER {pid}: Ready")
        limits = ", ".join(f"{d}={v}" for d, v in sorted(server.pinned_limits.items()))
        self.log("Server has started", who="Server", pid=pid)
        self.log(
            f"Active Threads Percentage set to {server.thread_percentage:.1f}",
            who="Server",
            pid=pid,
        )
        if limits:
            self.log(f"Device pinned memory limits set to {limits}", who="Server", pid=pid)
        return server

    def server_defaults(self) -> dict[str, str]:
        """A new server's limit for its device 0, from the daemon's defaults.

        Defaults set by UUID and by index are separate settings, and the UUID's is the one
        a server gives its clients: on an H200 (driver 580.159.04) 1536M was set by the
        GPU's UUID and then 2048M by index 0; ``get_default_device_pinned_mem_limit 0``
        showed 2G and by UUID 1G, the new server's limit for device 0 read back 1G, and
        clients without their own variable ran out at 1536 MiB (context included)
        (tests/data/mps_gpu_check/20261126T015109Z-h200/summary.txt, steps 3, 5 and 7).
        """
        visible = [d for d in self.visible_devices.split(",") if d]
        value = self.default_limits.get(visible[0]) if visible else None
        if value is None:
            value = self.default_limits.get("0")
        return {} if value is None else {"0": value}

    def _default_key(self, dev: str) -> str:
        """The daemon-default key of ``dev``: an index as given, a UUID as itself."""
        self._check_device(dev)  # unknown devices are refused
        return dev

    def _become_server(self) -> None:
        try:
            # Drop every inherited descriptor: the listening socket, the lock (it must
            # die with the daemon) and the connection being answered (its client waits
            # for EOF).
            os.closerange(3, 1 << 16)
            # Asked to stop (quit, hand-over, shutdown_server): a clean exit, status 0.
            signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
            signal.signal(signal.SIGUSR1, lambda *_: os._exit(1))
            parent = os.getppid()
            while os.getppid() == parent:
                time.sleep(0.1)
        finally:
            os._exit(0)

    def stop_server(self, server: _Server, *, force: bool = False) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGKILL if force else signal.SIGTERM)
        code = 0
        with contextlib.suppress(ChildProcessError):
            _pid, status = os.waitpid(server.pid, 0)
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code
        self.servers.pop(server.pid, None)
        self.log(f"Server {server.pid} exited with status {code}")

    def reap(self) -> None:
        while self.servers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code  # a signal shows like a shell's 128+N
            if self.servers.pop(pid, None) is not None:
                self.log(f"Server {pid} exited with status {code}")

    def server_limit_mib(self, server: _Server) -> int | None:
        """The server's per-client limit for device 0 (set by default or per server)."""
        value = server.pinned_limits.get("0")
        return None if value is None else parse_limit_mib(value)

    def prune_clients(self) -> None:
        """A client whose process has exited has left its server (CUDA tears it down)."""
        # Imported here, in the daemon: the front end (a process per command) stays light.
        from migd.backends.mps.procs import pid_alive

        for server in self.servers.values():
            for pid in [p for p in server.clients if not pid_alive(p)]:
                self._drop_client(server, pid)

    def _drop_client(self, server: _Server, pid: int) -> None:
        server.clients.discard(pid)
        server.client_limits.pop(pid, None)
        self.log(f"Client {{PID: {pid}}} exit", who="Server", pid=server.pid)

    def hand_over(self) -> None:
        """Per-user: once the current server has no clients, it exits for the next user."""
        if not self.pending_uids or any(s.clients for s in self.servers.values()):
            return
        uid = self.pending_uids.pop(0)
        for other in list(self.servers.values()):
            if other.uid != uid:
                self.stop_server(other)
        if not any(s.uid == uid for s in self.servers.values()):
            self.start_server(uid)

    def progress_quit(self) -> None:
        """Servers without clients end at once; the rest at the ``-t`` deadline."""
        forced = self.quit_deadline is not None and time.monotonic() >= self.quit_deadline
        for server in list(self.servers.values()):
            if forced or not server.clients:
                self.stop_server(server, force=forced)
        if not self.servers:
            self.running = False

    def crash_servers(self) -> None:
        for server in list(self.servers.values()):
            self.log("Server encountered a fatal exception. Shutting down")
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.pid, signal.SIGUSR1)

    def client_count(self) -> int:
        return sum(len(s.clients) for s in self.servers.values())

    # -- commands

    def handle(self, line: str) -> str:
        words = line.split()
        if not words:
            return ""
        cmd, args = words[0], words[1:]
        handler = getattr(self, f"cmd_{cmd}", None)
        if handler is None:
            return f"Invalid command: {cmd}"
        try:
            reply = str(handler(args))
            if cmd.startswith(("set_", "start_server")) and self.fault("chatty"):
                info = f"[fake] {cmd}: request accepted ({' '.join(args)})"
                reply = f"{info}\n{reply}" if reply else info
            return reply
        except (ValueError, IndexError, KeyError):
            return f"Invalid arguments for {cmd}: {' '.join(args)}"

    def _server(self, text: str) -> _Server:
        server = self.servers.get(int(text))
        if server is None:
            raise KeyError(text)
        return server

    def _check_device(self, dev: str) -> str:
        visible = [d for d in self.visible_devices.split(",") if d]
        if dev.isdigit() and (not visible or int(dev) < len(visible)):
            return dev
        if dev in visible:
            return "0" if len(visible) == 1 else str(visible.index(dev))
        raise ValueError(dev)

    @staticmethod
    def _limit_or_none(value: str) -> str | None:
        # "<int>G" or "<int>M" (MPS v2 interface docs). Anything else is taken without a
        # word and changes nothing here: a real H200 daemon (driver 580.159.04) answered
        # `set_default_device_pinned_mem_limit 0 lots` with no output and exit 0
        # (tests/data/mps_gpu_check/20261126T015109Z-h200/summary.txt, step 3). What it
        # did to the limit is not known, so only a read-back can tell a caller.
        if len(value) < 2 or value[-1] not in "GM" or not value[:-1].isdigit():
            return None
        return value

    @staticmethod
    def _check_percentage(text: str) -> float:
        # Both thread-percentage commands take a percentage in (0, 100].
        pct = float(text)
        if not 0 < pct <= 100:
            raise ValueError(text)
        return pct

    @staticmethod
    def _show_limit(value: str | None) -> str:
        # Drivers print limits of 1 GiB and more as whole, rounded-down "G": 1536M read
        # back as "1G" and 2048M as "2G" on an H200 (driver 580.159.04,
        # tests/data/mps_gpu_check/20261126T015109Z-h200/summary.txt, step 3), while a
        # client's limit was the 1536 MiB set; so callers cannot read back exactly what
        # they set.
        if value is None:
            return ""
        mib = int(value[:-1]) * (1024 if value[-1] == "G" else 1)
        return f"{mib // 1024}G" if mib >= 1024 else f"{mib}M"

    def cmd_get_server_list(self, args: list[str]) -> str:
        return "\n".join(str(pid) for pid in sorted(self.servers))

    def cmd_start_server(self, args: list[str]) -> str:
        if len(args) < 2 or args[0] != "-uid":
            raise ValueError("usage")
        uid = int(args[1])
        if self.fault("refuse-clients"):
            self.log(f"Failed to start server for user {uid}: {DEVICES_UNAVAILABLE_MESSAGE}")
            return f"Failed to start server: {DEVICES_UNAVAILABLE_MESSAGE}"
        if any(s.uid == uid for s in self.servers.values()):
            return ""
        # One server at a time: another user's server must drain first (it is asked to
        # shut down once its clients are done; this one starts after it).
        if any(s.clients for s in self.servers.values()):
            if uid not in self.pending_uids:
                self.pending_uids.append(uid)
            self.log(f"Server for user {uid} queued: another user's server has clients")
            return ""
        for other in list(self.servers.values()):
            self.stop_server(other)
        self.start_server(uid)
        return ""

    def cmd_shutdown_server(self, args: list[str]) -> str:
        self.stop_server(self._server(args[0]), force="-f" in args[1:])
        return ""

    def cmd_get_client_list(self, args: list[str]) -> str:
        return "\n".join(str(pid) for pid in sorted(self._server(args[0]).clients))

    def cmd_set_default_device_pinned_mem_limit(self, args: list[str]) -> str:
        if self.fault("ignore-limits"):
            return ""
        device = self._default_key(args[0])
        if self._limit_or_none(args[1]) is not None:
            self.default_limits[device] = args[1]
        else:
            self.log(f"Invalid pinned memory limit: {args[1]}")  # made-up wording
        return ""

    def cmd_get_default_device_pinned_mem_limit(self, args: list[str]) -> str:
        value = self.default_limits.get(self._default_key(args[0]))
        if value is None:
            # The real daemon printed nothing and logged this (H200 control.log).
            self.log("No default pinned memory limit set for the device!")
        return self._show_limit(value)

    def cmd_set_device_pinned_mem_limit(self, args: list[str]) -> str:
        server = self._server(args[0])
        if self.fault("ignore-limits"):
            return ""
        device = self._check_device(args[1])
        if self._limit_or_none(args[2]) is not None:
            server.pinned_limits[device] = args[2]
        return ""

    def cmd_get_device_pinned_mem_limit(self, args: list[str]) -> str:
        server = self._server(args[0])
        return self._show_limit(server.pinned_limits.get(self._check_device(args[1])))

    def cmd_set_default_active_thread_percentage(self, args: list[str]) -> str:
        pct = self._check_percentage(args[0])
        self.default_thread_percentage = pct
        return f"{pct:.1f}"

    def cmd_get_default_active_thread_percentage(self, args: list[str]) -> str:
        return f"{self.default_thread_percentage:.1f}"

    def cmd_set_active_thread_percentage(self, args: list[str]) -> str:
        server = self._server(args[0])
        pct = self._check_percentage(args[1])
        server.thread_percentage = pct
        return f"{pct:.1f}"

    def cmd_get_active_thread_percentage(self, args: list[str]) -> str:
        return f"{self._server(args[0]).thread_percentage:.1f}"

    def cmd_quit(self, args: list[str]) -> str:
        timeout: float | None = None
        if args:
            if args[0] != "-t" or len(args) != 2:
                raise ValueError("usage")
            timeout = float(args[1])
        self.quitting = True
        if timeout is not None:
            deadline = time.monotonic() + timeout
            self.quit_deadline = min(self.quit_deadline or deadline, deadline)
        self.log("Received quit: no new clients; waiting for the servers' clients to finish")
        self.progress_quit()
        return ""

    # test-only commands

    def cmd_fake_register_client(self, args: list[str]) -> str:
        client_pid, uid = int(args[0]), int(args[1])
        env_limit = args[2] if len(args) > 2 else ""
        if self.quitting:
            self.log(f"NEW CLIENT {client_pid} from user {uid}: the daemon is shutting down")
            return f"ERROR: {DEVICES_UNAVAILABLE_MESSAGE}"
        if self.fault("refuse-clients"):
            self.log(f"NEW CLIENT {client_pid} from user {uid}: {DEVICES_UNAVAILABLE_MESSAGE}")
            return f"ERROR: {DEVICES_UNAVAILABLE_MESSAGE}"
        if self.client_count() >= self.max_clients:
            full = next((s for s in self.servers.values() if s.clients), None)
            self.log(
                CLIENT_CAP_LOG.format(cap=self.max_clients),
                who="Server",
                pid=full.pid if full else os.getpid(),
            )
            return f"ERROR: {CLIENT_CAP_MESSAGE}"
        server_uid = 0 if self.multi_user else uid
        server = next((s for s in self.servers.values() if s.uid == server_uid), None)
        if server is None:
            busy = [s for s in self.servers.values() if s.clients]
            if busy:
                self.log(
                    f"NEW CLIENT {client_pid} from user {uid}: Server is not ready, "
                    "push client to pending list"
                )
                if server_uid not in self.pending_uids:
                    self.pending_uids.append(server_uid)
                return f"ERROR: pending: server {busy[0].pid} of user {busy[0].uid} is busy"
            for other in list(self.servers.values()):
                self.stop_server(other)
            self.log(
                f"NEW CLIENT {client_pid} from user {uid}: Server is not ready, "
                "push client to pending list"
            )
            server = self.start_server(server_uid)
        else:
            self.log(f"NEW CLIENT {client_pid} from user {uid}: Server already exists")
        if server_uid in self.pending_uids:
            self.pending_uids.remove(server_uid)
        # The server's limit binds; the client's own variable can only lower it.
        limit = self.server_limit_mib(server)
        own = parse_pinned_limit_env(env_limit, self.visible_devices.split(",")[0] or None)
        if own is not None:
            limit = own if limit is None else min(limit, own)
        server.clients.add(client_pid)
        server.client_limits[client_pid] = limit
        self.log(f"Client {{PID: {client_pid}}} connected", who="Server", pid=server.pid)
        if limit is not None:
            self.log(
                f"Client {{PID: {client_pid}}}: device pinned memory limit {limit}M",
                who="Server",
                pid=server.pid,
            )
        return str(server.pid)

    def cmd_fake_client_limit(self, args: list[str]) -> str:
        client_pid = int(args[0])
        for server in self.servers.values():
            if client_pid in server.clients:
                limit = server.client_limits.get(client_pid)
                return "" if limit is None else str(limit)
        raise KeyError(args[0])

    def cmd_fake_unregister_client(self, args: list[str]) -> str:
        client_pid = int(args[0])
        for server in self.servers.values():
            if client_pid in server.clients:
                self._drop_client(server, client_pid)
        return ""

    def cmd_fake_status(self, args: list[str]) -> str:
        return json.dumps(
            {
                "pid": os.getpid(),
                "multi_user": self.multi_user,
                "visible_devices": self.visible_devices,
                "default_pinned_limits": self.default_limits,
                "default_thread_percentage": self.default_thread_percentage,
                "pending_uids": list(self.pending_uids),
                "quitting": self.quitting,
                "servers": [
                    {
                        "pid": s.pid,
                        "uid": s.uid,
                        "pinned_limits": s.pinned_limits,
                        "thread_percentage": s.thread_percentage,
                        "clients": sorted(s.clients),
                        "client_limits_mib": {str(k): v for k, v in s.client_limits.items()},
                    }
                    for s in self.servers.values()
                ],
            },
            sort_keys=True,
        )

    # -- loop

    def serve(self, ready_fd: int | None) -> int:
        os.chdir(self.pipe_dir)  # bind relative: AF_UNIX paths are limited to 107 bytes
        with contextlib.suppress(FileNotFoundError):
            Path(CONTROL_SOCKET_NAME).unlink()  # we hold the lock: an old socket is stale
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(CONTROL_SOCKET_NAME)
        self.sock.listen(64)
        tmp = Path(f".{PID_FILE_NAME}.tmp")
        tmp.write_text(f"{os.getpid()}\n", encoding="utf-8")
        tmp.replace(PID_FILE_NAME)
        self.log(f"Starting control daemon using socket {self.pipe_dir / CONTROL_SOCKET_NAME}")
        self.log(
            "To connect CUDA applications to this daemon, set env "
            f"CUDA_MPS_PIPE_DIRECTORY={self.pipe_dir}"
        )
        self.log("CUDA MPS Control binary version: fake (migd.backends.simulated)")
        if ready_fd is not None:
            os.write(ready_fd, b"1")
            os.close(ready_fd)
        signal.signal(signal.SIGTERM, lambda *_: self._terminate())
        selector = selectors.DefaultSelector()
        selector.register(self.sock, selectors.EVENT_READ)
        while self.running:
            for _ in selector.select(timeout=_TICK_S):
                conn, _addr = self.sock.accept()
                # The real server sees a client leave when its connection drops, before
                # any later command: never answer with a client that has exited.
                self.prune_clients()
                if not self._answer(conn):
                    conn.close()
                if self.stopped():
                    break
            self.reap()
            self.prune_clients()
            if self.quitting:
                self.progress_quit()
            else:
                self.hand_over()
            if self.fault("die"):
                os._exit(1)  # leave pid file and socket behind, like a crash
            if self.fault("crash-server"):
                self.crash_servers()
            while self.fault("hang"):
                time.sleep(_TICK_S)
        self._cleanup()
        # The front ends that sent `quit` return only now, with the daemon gone.
        for waiter in self.quit_waiters:
            with contextlib.suppress(OSError):
                waiter.sendall(_END)
                waiter.close()
        return 0

    def _answer(self, conn: socket.socket) -> bool:
        """Answer one command; True if the connection is kept (a ``quit`` waiting)."""
        while self.fault("hang"):
            time.sleep(_TICK_S)
        conn.settimeout(5.0)
        data = b""
        try:
            while not data.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            command = data.decode("utf-8", "replace").strip()
            reply = self.handle(command)
            if command.split()[:1] == ["quit"] and not reply:
                self.quit_waiters.append(conn)
                return True
            conn.sendall(reply.encode() + _END)
        except OSError:
            pass
        return False

    def stopped(self) -> bool:
        return not self.running

    def _terminate(self) -> None:
        # SIGTERM: stop the servers, clean up and leave at once, even mid-"hang".
        for server in list(self.servers.values()):
            self.stop_server(server)
        self._cleanup()
        os._exit(0)

    def _cleanup(self) -> None:
        if self.cleaned_up:
            return
        self.cleaned_up = True
        for name in (PID_FILE_NAME, CONTROL_SOCKET_NAME):
            with contextlib.suppress(FileNotFoundError):
                (self.pipe_dir / name).unlink()
        self.log("Control daemon exiting")


def _run_daemon(pipe_dir: Path, log_dir: Path, *, multi_user: bool, foreground: bool) -> int:
    pipe_dir.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(pipe_dir / LOCK_FILE_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(ALREADY_RUNNING_MESSAGE)
        return 1
    if foreground:
        daemon = _Daemon(pipe_dir, log_dir, multi_user=multi_user)
        daemon.lock_fd = lock_fd
        return daemon.serve(None)
    read_fd, write_fd = os.pipe()
    if os.fork() > 0:  # the front process: wait until the daemon is ready
        os.close(write_fd)
        os.close(lock_fd)  # the daemon's copy keeps the lock
        ok = os.read(read_fd, 1) == b"1"
        os.close(read_fd)
        return 0 if ok else 1
    os.close(read_fd)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    # The daemon proper: drop the caller's stdio so whoever started us sees EOF.
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    status = 1
    try:
        daemon = _Daemon(pipe_dir, log_dir, multi_user=multi_user)
        daemon.lock_fd = lock_fd
        status = daemon.serve(write_fd)
    finally:
        os._exit(status)


# -- front end --------------------------------------------------------------------------------


def _send(command: str, socket_path: str = CONTROL_SOCKET_NAME) -> str | None:
    """One command to the daemon (default: in the current directory); ``None`` if the
    link broke."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(socket_path)
        sock.sendall(command.encode() + b"\n")
        data = b""
        while not data.endswith(_END):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    if not data.endswith(_END):
        return None
    return data[: -len(_END)].decode("utf-8", "replace")


class ClientRefused(RuntimeError):
    """The daemon would not take the client (what CUDA init reports as an error)."""


def connect_client(
    pipe_dir: Path | str,
    pid: int,
    uid: int,
    env_limit: str = "",
    *,
    wait_s: float = 60.0,
) -> tuple[int, int | None] | None:
    """Connect a simulated CUDA client the way CUDA init does; ``(server pid, limit MiB)``.

    ``None`` when no daemon answers on ``pipe_dir``: the program then runs *without*
    MPS, and without a limit ("If the connection attempt fails, the program continues
    to run as it normally would without MPS", ``nvidia-cuda-mps-control(1)``). A client
    of another user waits, as the real one hangs in CUDA init, until that user's server
    has drained (at most ``wait_s``).

    Raises:
        ClientRefused: the daemon refused the client (client cap, a refusing device,
            shutting down), or the wait ran out.
    """
    path = str(Path(pipe_dir) / CONTROL_SOCKET_NAME)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            reply = _send(f"fake_register_client {pid} {uid} {env_limit}".strip(), path)
        except OSError:
            return None
        if reply is None:
            raise ClientRefused("the MPS control daemon broke the connection")
        reply = reply.strip()
        if reply.isdigit():
            limit = (_send(f"fake_client_limit {pid}", path) or "").strip()
            return int(reply), int(limit) if limit.isdigit() else None
        if not reply.startswith("ERROR: pending") or time.monotonic() >= deadline:
            raise ClientRefused(reply.removeprefix("ERROR: "))
        time.sleep(_TICK_S)


def disconnect_client(pipe_dir: Path | str, pid: int) -> None:
    """The client's CUDA context goes away (best effort: the daemon also notices its exit)."""
    with contextlib.suppress(OSError):
        _send(f"fake_unregister_client {pid}", str(Path(pipe_dir) / CONTROL_SOCKET_NAME))


def _run_client(pipe_dir: Path) -> int:
    try:
        os.chdir(pipe_dir)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(CONTROL_SOCKET_NAME)
    except OSError:
        print(NO_DAEMON_MESSAGE)
        return 1
    for raw in sys.stdin:
        command = raw.strip()
        if not command:
            continue
        try:
            reply = _send(command)
        except OSError:
            return 1
        if reply is None:
            return 1
        if reply:
            print(reply, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    known = {"-d", "-f", "-M", "-v", "-h", "--help"}
    unknown = [a for a in args if a not in known]
    if unknown or "-h" in args or "--help" in args:
        print("usage: nvidia-cuda-mps-control [-d | -f] [-M]   (fake, migd.testing)")
        return 0 if not unknown else 1
    if "-v" in args:
        print("fake nvidia-cuda-mps-control (migd.backends.simulated.mps_control)")
        return 0
    pipe_dir = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    log_dir = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"))
    if "-d" in args or "-f" in args:
        return _run_daemon(
            pipe_dir.resolve(),
            log_dir.resolve(),
            multi_user="-M" in args,
            foreground="-f" in args,
        )
    return _run_client(pipe_dir)


if __name__ == "__main__":
    sys.exit(main())
