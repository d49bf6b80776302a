"""The host's process table (:class:`migd.ports.ProcessTable`) over ``psutil``."""

from __future__ import annotations

import psutil

# psutil derives create_time from boot time plus clock ticks (1/100 s on Linux), so the
# same process always reports the same value; a reused PID starts at least a tick later.
_START_TIME_TOLERANCE_S = 0.005


class PsutilProcessTable:
    """Liveness, start time and owner of host processes (``ps -o lstart,uid -p PID``).

    A PID alone does not identify a process for long: after it exits the kernel may
    give the number to a new one. Callers keep the start time seen at lease time and
    pass it to :meth:`alive`, which then rejects a different process under the same PID.
    """

    def alive(self, pid: int, start_time: float | None = None) -> bool:
        """True if ``pid`` runs (not a zombie) and, when given, started at ``start_time``."""
        if pid <= 0:
            return False
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False
            if start_time is None:
                return True
            return bool(abs(proc.create_time() - start_time) <= _START_TIME_TOLERANCE_S)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return False
        except psutil.AccessDenied:
            # It exists (the kernel said so by denying); without a start time we cannot
            # tell PID reuse apart, so only trust it when none was asked for.
            return start_time is None

    def start_time(self, pid: int) -> float | None:
        """Start time in seconds since the epoch, ``None`` if no such process."""
        if pid <= 0:
            return None
        try:
            return float(psutil.Process(pid).create_time())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def uid(self, pid: int) -> int | None:
        """Real uid of the process, ``None`` if no such process (or not readable)."""
        if pid <= 0:
            return None
        try:
            return int(psutil.Process(pid).uids().real)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def parent(self, pid: int) -> int | None:
        """The parent's pid (``ps -o ppid``), ``None`` if no such process."""
        if pid <= 0:
            return None
        try:
            return int(psutil.Process(pid).ppid())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None


__all__ = ["PsutilProcessTable"]
