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

The package, by job: :mod:`.manager` (:class:`MpsManager`, the coordinator: which
daemon runs for which shares), :mod:`.lifecycle` (start, ``quit``, kill one daemon),
:mod:`.commands` (front-end commands to a daemon), :mod:`.limits` (pinned memory,
thread percentage, the prestarted server), :mod:`.health` (what is wrong, log
scanning), :mod:`.status` (``migctl status``), :mod:`.records` (directories, pid
files, migd's record), :mod:`.runner` (how a command runs, as whom), :mod:`.procs`
(``/proc`` and PID checks), :mod:`.config` and :mod:`.errors`.
"""

from __future__ import annotations

from .commands import NO_DAEMON_MESSAGE
from .config import MpsManagerConfig
from .errors import (
    MpsBinaryNotFound,
    MpsCommandFailed,
    MpsCommandTimeout,
    MpsDaemonStartFailed,
    MpsDeviceBusy,
    MpsServerStillRunning,
)
from .health import (
    CONTROL_LOG_NAME,
    LOG_PROBLEMS,
    SERVER_EXIT_OK,
    SERVER_LOG_NAME,
    HealthEvent,
    HealthReport,
)
from .lifecycle import ALREADY_RUNNING_MESSAGE
from .manager import MpsManager
from .records import (
    CONTROL_SOCKET_NAME,
    PID_FILE_NAME,
    RECORD_FILE_NAME,
    SOCKET_PATH_MAX_BYTES,
    AdoptionReport,
    DaemonRecord,
)
from .runner import CommandResult, CommandRunner, RunAs, SubprocessRunner
from .status import MpsDaemonStatus

__all__ = [
    "ALREADY_RUNNING_MESSAGE",
    "CONTROL_LOG_NAME",
    "CONTROL_SOCKET_NAME",
    "LOG_PROBLEMS",
    "NO_DAEMON_MESSAGE",
    "PID_FILE_NAME",
    "RECORD_FILE_NAME",
    "SERVER_EXIT_OK",
    "SERVER_LOG_NAME",
    "SOCKET_PATH_MAX_BYTES",
    "AdoptionReport",
    "CommandResult",
    "CommandRunner",
    "DaemonRecord",
    "HealthEvent",
    "HealthReport",
    "MpsBinaryNotFound",
    "MpsCommandFailed",
    "MpsCommandTimeout",
    "MpsDaemonStartFailed",
    "MpsDaemonStatus",
    "MpsDeviceBusy",
    "MpsManager",
    "MpsManagerConfig",
    "MpsServerStillRunning",
    "RunAs",
    "SubprocessRunner",
]
