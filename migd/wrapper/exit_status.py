"""The wrapper's end, recorded by HTCondor as the job's own would be.

HTCondor takes ``ExitCode``, ``ExitBySignal`` and ``ExitSignal`` from the wait
status of the process it started (user_proc.cpp, ``WIFSIGNALED``/``WTERMSIG``), so
the wrapper ends the way the job did:

* normally, it exits with the job's code, or dies of the job's signal (SIG_DFL, then
  ``kill`` on itself);
* with ``USE_PID_NAMESPACES = True`` and ``condor_pid_ns_init`` (the default,
  ``USE_PID_NAMESPACE_INIT``), the starter ignores the wait status and reads
  ``Exited: <wait status>`` from the file ``$_CONDOR_PID_NS_INIT_STATUS_FILENAME``
  names, which ``condor_pid_ns_init`` writes for the job (vanilla_proc.cpp
  ``pidNameSpaceReaper``). That file holds the job's real end (the wrapper reads it
  for its own decisions too: ``condor_pid_ns_init`` itself exits 0 for a job killed by a
  signal); when the wrapper ends with a code of its own (86, 85, 1) or was stopped
  before any job ran, it writes the file itself, or the starter would record the last
  attempt's status, or stop with "condor_pid_ns_init did not run properly";
* as PID 1 of a PID namespace without ``condor_pid_ns_init``, the kernel ignores a
  signal the wrapper sends itself (pid_namespaces(7)); only a fault it raises is
  delivered. SIGSEGV is reproduced that way; any other signal ends in ``128 + N``,
  what a shell reports (a job that is PID 1 itself cannot die of those signals either).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from migd.wrapper.signals import PID_NS_STATUS_ENV, under_pid_ns_init

# Signals whose disposition cannot be changed: re-raised without signal.signal().
UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)


@dataclass(frozen=True)
class JobEnd:
    """How a process ended: ``exit_code`` or ``signum`` (one of them)."""

    exit_code: int | None = None
    signum: int | None = None

    @classmethod
    def from_wait_status(cls, status: int) -> JobEnd:
        if os.WIFSIGNALED(status):
            return cls(signum=os.WTERMSIG(status))
        return cls(exit_code=os.WEXITSTATUS(status))

    @classmethod
    def from_returncode(cls, returncode: int) -> JobEnd:
        """From ``subprocess``'s returncode (negative: the signal)."""
        return cls(signum=-returncode) if returncode < 0 else cls(exit_code=returncode)

    @property
    def wait_status(self) -> int:
        """The status ``waitpid`` reports for this end (as ``condor_pid_ns_init`` writes it)."""
        if self.signum is not None:
            return self.signum & 0x7F
        return ((self.exit_code or 0) & 0xFF) << 8


def pid_ns_status_path(env: Mapping[str, str] | None = None) -> Path | None:
    value = (os.environ if env is None else env).get(PID_NS_STATUS_ENV)
    return Path(value) if value else None


def read_pid_ns_status(path: Path | None) -> JobEnd | None:
    """The job's end as ``condor_pid_ns_init`` wrote it (``Exited: N``), or ``None``
    (no file, ``ExecFailed``, unreadable)."""
    if path is None:
        return None
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return None
    label, _, number = text.partition(":")
    if label.strip() != "Exited":
        return None
    try:
        return JobEnd.from_wait_status(int(number.strip()))
    except ValueError:
        return None


def record_for_starter(
    end: JobEnd, command: Sequence[str], env: Mapping[str, str] | None = None
) -> None:
    """Under ``condor_pid_ns_init`` (the wrapper's ``command`` is it): tell the starter
    how the job ended (never raises). Nothing otherwise: a ``migd-run`` inside such a
    job inherits the variable, and ``condor_pid_ns_init`` keeps a file it finds."""
    env = os.environ if env is None else env
    path = pid_ns_status_path(env)
    if path is None or not under_pid_ns_init(command, env):
        return
    with contextlib.suppress(OSError):
        path.write_text(f"Exited: {end.wait_status}\n")


def die_of(signum: int) -> None:
    """End this process by ``signum`` so the starter records ExitBySignal; where the
    kernel will not deliver it (PID 1 of a namespace), exit ``128 + signum``."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    if signum not in UNCATCHABLE:
        signal.signal(signum, signal.SIG_DFL)
    if os.getpid() == 1:
        if signum == signal.SIGSEGV:
            _fault()
        raise SystemExit(128 + signum)
    os.kill(os.getpid(), signum)
    time.sleep(1.0)  # the signal is delivered before this returns
    raise SystemExit(128 + signum)


def _fault() -> None:
    """A real invalid read: a fault's SIGSEGV reaches even a namespace's init.

    From a page mapped with no access (address 0 can be mapped, and ctypes checks
    for NULL): the read faults whatever the host's ``vm.mmap_min_addr``."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # and PROT_NONE (0)
    page = libc.mmap(None, mmap.PAGESIZE, 0, flags, -1, 0)
    if page is None or page == ctypes.c_void_p(-1).value:
        return  # no page: exit 128 + N like any other signal
    ctypes.c_char.from_address(page).value  # noqa: B018 - the read is the point
