"""The host's process table (:class:`migd.ports.ProcessTable`) over ``/proc`` and ``psutil``.

A process's start is read from ``/proc/PID/stat`` field 22 (``starttime``): clock
ticks since boot, which the kernel never changes. Wall-clock start times (what
``psutil.create_time()`` returns: boot time + ticks) move when the clock is stepped
(NTP, an admin's ``date -s``): the kernel's boot time in ``/proc/stat`` moves with it,
so after a step every holder would look like a different process and every lease
would be reclaimed.
"""

from __future__ import annotations

import os
import time

import psutil

_HZ = os.sysconf("SC_CLK_TCK")
# Starts recorded by older migd versions were wall-clock seconds since the epoch, always
# far above the seconds since boot of any process; they are compared the old way.
_LEGACY_TOLERANCE_S = 0.005


def _stat(pid: int) -> tuple[bytes, int] | None:
    """(state, start ticks since boot) of ``pid``, ``None`` if there is no such process."""
    try:
        # os.open/os.read, not Path.read_bytes: 3 system calls, not 9 (a buffered file
        # object asks for fstat, ioctl and lseek, and reads twice); this runs for every
        # lease request (the holder's start).
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.read(fd, 4096)  # the line is at most a few hundred bytes
        finally:
            os.close(fd)
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    except PermissionError:  # /proc mounted with hidepid: it exists, its start is unknown
        return b"?", -1
    # comm (field 2) may hold spaces and parentheses: fields 3.. follow the last ")"
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0], int(fields[19])


class PsutilProcessTable:
    """Liveness, start and owner of host processes (``ps -o stat,lstart,uid -p PID``).

    A PID alone does not identify a process for long: after it exits the kernel may
    give the number to a new one. Callers keep the start seen at lease time
    (:meth:`start_time`) and pass it to :meth:`alive`, which then rejects a different
    process under the same PID.
    """

    def alive(self, pid: int, start_time: float | None = None) -> bool:
        """True if ``pid`` runs (not a zombie) and, when given, started at ``start_time``
        (a value from :meth:`start_time`, or a wall-clock start recorded by migd < 0.2)."""
        if pid <= 0:
            return False
        stat = _stat(pid)
        if stat is None or stat[0] in (b"Z", b"X"):
            return False
        if start_time is None:
            return True
        ticks = stat[1]
        if ticks < 0:  # cannot tell PID reuse apart without the start
            return False
        if start_time > time.clock_gettime(time.CLOCK_BOOTTIME) + 1:  # legacy: epoch seconds
            created = float(psutil.boot_time()) + ticks / _HZ
            return abs(created - start_time) <= _LEGACY_TOLERANCE_S
        return abs(ticks / _HZ - start_time) < 0.5 / _HZ

    def start_time(self, pid: int) -> float | None:
        """When ``pid`` started, in seconds since boot (its start ticks / ``CLK_TCK``);
        ``None`` if there is no such process. Immune to wall-clock steps."""
        if pid <= 0:
            return None
        stat = _stat(pid)
        return None if stat is None or stat[1] < 0 else stat[1] / _HZ

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
