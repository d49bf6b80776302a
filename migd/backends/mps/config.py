"""The ``[mps]`` settings of the MPS manager."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from migd.core.mps import UserPolicy


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

    @property
    def multi_user(self) -> bool:
        return self.policy is UserPolicy.MULTI_USER

    def serves_uid(self, uid: int) -> int:
        """The user whose server a share of ``uid`` runs on: ``uid``, or root (0) in
        multi-user mode, where one daemon serves everybody."""
        return 0 if self.multi_user else uid
