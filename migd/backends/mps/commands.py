"""Commands to a running control daemon, sent the documented way.

Every command goes through a front-end invocation with the daemon's pipe directory
(``echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=<pipe> nvidia-cuda-mps-control``),
as the daemon's user, with the command timeout.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

from migd.errors import MpsError

from .config import MpsManagerConfig
from .errors import MpsCommandFailed
from .procs import parse_pids
from .records import Daemon, DaemonRecord
from .runner import CommandRunner, RunAs

NO_DAEMON_MESSAGE = "Cannot find MPS control daemon process"


class DaemonCommands:
    """Sends commands to control daemons through ``runner``, as ``config`` says."""

    def __init__(self, config: MpsManagerConfig, runner: CommandRunner) -> None:
        self.config = config
        self.runner = runner

    def base_env(self) -> dict[str, str]:
        if self.config.env is not None:
            return dict(self.config.env)
        return {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}

    def daemon_env(self, record: DaemonRecord) -> dict[str, str]:
        env = self.base_env()
        env["CUDA_MPS_PIPE_DIRECTORY"] = record.pipe_dir
        env["CUDA_MPS_LOG_DIRECTORY"] = record.log_dir
        env["CUDA_VISIBLE_DEVICES"] = record.device_uuid
        return env

    @staticmethod
    def run_as(record: DaemonRecord) -> RunAs | None:
        if record.run_as_self or record.uid == 0:
            return None
        return RunAs(record.uid, record.gid)

    def command(self, daemon: Daemon, command: str) -> str:
        """Send one command (or several, one a line) through the front end; return stdout.

        Raises:
            MpsCommandTimeout, MpsBinaryNotFound: see :class:`.runner.SubprocessRunner`.
            MpsCommandFailed: non-zero exit: no daemon, or the link to it broke.
        """
        record = daemon.record
        result = self.runner.run(
            [self.config.binary],
            env=self.daemon_env(record),
            stdin=command + "\n",
            timeout_s=self.config.command_timeout_s,
            run_as=self.run_as(record),
        )
        if result.returncode != 0 or NO_DAEMON_MESSAGE in result.output:
            raise MpsCommandFailed(
                f"MPS command `{command}` for {record.device_uuid} failed "
                f"(exit {result.returncode}): {result.output or 'no output'}",
                device_uuid=record.device_uuid,
                command=command,
            )
        return result.stdout

    def try_command(self, daemon: Daemon, command: str) -> str | None:
        try:
            return self.command(daemon, command)
        except MpsError as exc:
            daemon.last_error = str(exc)
            return None

    def clients(self, daemon: Daemon, servers: Iterable[int]) -> Iterator[int]:
        """The client PIDs of ``servers``, one ``get_client_list`` each, as they are read.

        Raises:
            MpsError: a command failed (the clients read before it have been yielded).
        """
        for server in servers:
            yield from parse_pids(self.command(daemon, f"get_client_list {server}"))
