"""migd's exit statuses, as systemd and an admin read them.

The numbers are the LSB init-script codes that systemd names in ``systemctl status``
(systemd.exec(5), "Process Exit Codes"): ``status=2/INVALIDARGUMENT``,
``status=5/NOTINSTALLED``. The shipped unit (``systemd/migd.service``) does not restart
on :data:`CONFIG` (``RestartPreventExitStatus=2``): retrying cannot fix a setting. It
restarts on :data:`NO_DRIVER` and :data:`FAILURE`, a bounded number of times
(``StartLimitBurst``): a driver loaded late or a disk made writable again is picked up,
a node without a driver ends as a failed unit instead of restarting for ever.
"""

from __future__ import annotations

from migd.errors import AlreadyRunning, ConfigError, DriverUnavailable

#: Clean stop (SIGTERM), or ``--check-config`` found nothing wrong.
OK = 0
#: Anything else that stopped migd (state disk full or read-only, a bug).
FAILURE = 1
#: A configuration error (file, variable, flag, or what the values mean on this node:
#: unsafe or symlinked directories, another migd already serving, a profile no GPU has).
CONFIG = 2
#: No NVIDIA driver: NVML cannot be loaded or initialised, so the node cannot serve.
NO_DRIVER = 5


def exit_status(exc: BaseException) -> int:
    """The exit status for the error that stopped a start."""
    if isinstance(exc, ConfigError | AlreadyRunning):
        return CONFIG
    if isinstance(exc, DriverUnavailable):
        return NO_DRIVER
    return FAILURE
