"""Which signals the wrapper passes on to the job, and to which process.

HTCondor's starter signals only the process it started (``JobPid``, the wrapper):
the soft kill (``kill_sig``, ``KillSig``), ``remove_kill_sig`` (``RemoveKillSig``),
``hold_kill_sig`` (``HoldKillSig``) and the periodic checkpoint signal
(``+CheckpointSig``, default the soft kill signal), each any signal number
(vanilla_proc.cpp ``Ckpt``, os_proc.cpp ``ShutdownGraceful``). Suspend and
continue are not signals to ``JobPid``: the procd stops and continues every
process of the job's family itself. So the wrapper passes on every signal the
job ad can name, and the ones a terminal or an admin's ``kill`` may send.

Two shapes of the process tree:

* plain: the job is the wrapper's child in its own process group; a signal goes to
  that group (the job and whatever it started), as it would reach a job that the
  starter had started itself.
* ``USE_PID_NAMESPACES = True``: the starter puts ``condor_pid_ns_init`` between
  the wrapper and the job (``USER_JOB_WRAPPER`` is prepended to the command after
  the starter replaced it with ``condor_pid_ns_init``: vanilla_proc.cpp
  ``StartJob``, os_proc.cpp ``StartJob``). ``condor_pid_ns_init`` passes HUP, INT,
  QUIT, ILL, ABRT, TERM, SEGV, PIPE, USR1 and USR2 to the job and, as PID 1
  without a handler, never receives any other (condor_pid_ns_init.cpp). The
  wrapper, now PID 1 itself, signals ``condor_pid_ns_init`` alone with exactly
  those: the job gets each once, and what the job would not have got without
  migd it does not get with it.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from migd.core.lease_end import signal_number

# Attributes of the job ad that name a signal the starter sends to JobPid: the first
# three stop the job (soft kill on vacate, condor_rm, condor_hold), the last asks it to
# checkpoint (and exit with its checkpoint exit code, which the starter then restarts).
STOP_ATTRS = ("KillSig", "RemoveKillSig", "HoldKillSig")
SIGNAL_ATTRS = (*STOP_ATTRS, "CheckpointSig")
# The "HTCondor is stopping this job" signals: no on-node restart after one of them.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP})
# Never handled: cannot be (KILL, STOP), or are the wrapper's own business (CHLD).
NEVER = frozenset({signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD})
# Raised by the wrapper's own faults or writes (a real SIGSEGV in the interpreter would
# loop on a Python-level handler; a write to a closed pipe is the wrapper's, not the
# job's): passed on only when the job ad names them, or condor_pid_ns_init would.
OWN = frozenset(
    {
        signal.SIGSEGV,
        signal.SIGBUS,
        signal.SIGILL,
        signal.SIGFPE,
        signal.SIGTRAP,
        signal.SIGSYS,
        signal.SIGABRT,
        signal.SIGPIPE,
        signal.SIGXFSZ,
    }
)
# What condor_pid_ns_init installs handlers for and passes to the job.
PID_NS_INIT_SIGNALS = frozenset(
    {
        signal.SIGHUP,
        signal.SIGINT,
        signal.SIGQUIT,
        signal.SIGILL,
        signal.SIGABRT,
        signal.SIGTERM,
        signal.SIGSEGV,
        signal.SIGPIPE,
        signal.SIGUSR1,
        signal.SIGUSR2,
    }
)
PID_NS_INIT = "condor_pid_ns_init"
PID_NS_STATUS_ENV = "_CONDOR_PID_NS_INIT_STATUS_FILENAME"


def named_signals(job_ad: Mapping[str, Any], attrs: Iterable[str] = SIGNAL_ATTRS) -> frozenset[int]:
    """The signals the job ad says the starter may send (``KillSig`` and the like)."""
    found = set()
    for attr in attrs:
        value = job_ad.get(attr)
        if value is None or isinstance(value, bool) or not isinstance(value, str | int):
            continue
        number = signal_number(value, default=0)
        if number:
            found.add(number)
    return frozenset(found)


def under_pid_ns_init(command: Iterable[str], env: Mapping[str, str]) -> bool:
    """True when the wrapper's command is HTCondor's ``condor_pid_ns_init`` (the starter
    sets its status-file variable in the same step): the job is its child."""
    first = next(iter(command), "")
    return bool(env.get(PID_NS_STATUS_ENV)) and PurePath(first).name == PID_NS_INIT


@dataclass(frozen=True)
class ForwardPlan:
    """Which signals to catch, which of them stop the job, and how to send them on."""

    forwarded: frozenset[int]
    stopping: frozenset[int]
    # True: send to the child only (condor_pid_ns_init passes them on); False: to the
    # job's process group.
    child_only: bool = False
    named: frozenset[int] = field(default_factory=frozenset)

    def send(self, child_pid: int, signum: int) -> None:
        """Pass ``signum`` on (ProcessLookupError/PermissionError: the job is gone)."""
        if self.child_only:
            os.kill(child_pid, signum)
        else:
            os.killpg(child_pid, signum)


def forward_plan(
    named: Iterable[int] = (), *, pid_ns_init: bool = False, stop: Iterable[int] = ()
) -> ForwardPlan:
    """The signals to pass on to a job whose ad names ``named``.

    ``stop`` (the job's kill signals) stop the job like SIGTERM does: the wrapper does
    not restart a job HTCondor is stopping.
    """
    named_set = frozenset(int(s) for s in named) - NEVER
    valid = {int(s) for s in signal.valid_signals()}
    forwarded: set[int] = {int(s) for s in PID_NS_INIT_SIGNALS}
    if not pid_ns_init:
        forwarded = {s for s in valid if s not in NEVER and s not in OWN} | named_set
    stopping = {int(s) for s in STOP_SIGNALS} | {int(s) for s in stop if s not in NEVER}
    return ForwardPlan(
        forwarded=frozenset(s for s in forwarded if s in valid),
        stopping=frozenset(stopping),
        child_only=pid_ns_init,
        named=named_set,
    )
