"""Why a lease ended, and what the wrapper does about an end its job did not ask for (pure).

Every lease that ends carries a :class:`LeaseEndReason` (the lease's ``end_reason``
in the API: ``get_lease``, ``leases``, the release reply). One end is the job's own:
``released``, its holder (the wrapper) gave the lease back. Every other end of a
granted lease means migd took the partition back while the job may still run on it,
and migd may hand the same MIG instance or MPS share to another job: the job must
stop. ``gpu_lost`` is set while the lease is still active (an NVML event lost the
GPU's work; the wrapper releases the lease once the job is stopped).

:class:`StopPlan` is the wrapper's decision, stepped with the time it is given (a
manual clock in tests): the job's kill signal at once (HTCondor's ``kill_sig``,
default SIGTERM), SIGKILL of its process group when it has not exited within the
grace period (``[wrapper] term_grace_s``).
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NotRequired, TypedDict


class LeaseEndReason(StrEnum):
    """Why a lease ended (docs/api.md, "Why a lease ended")."""

    #: Its holder released it: the job asked (the only end that does not stop a job).
    RELEASED = "released"
    #: Withdrawn before it was granted (client gone, wait timed out, daemon stopping or
    #: restarted while it waited).
    CANCELLED = "cancelled"
    #: Queued past its deadline (``wait_s``): no partition became free.
    QUEUE_TIMEOUT = "queue_timeout"
    #: The partition could not be prepared (NVML failed).
    FAILED = "failed"
    #: Released by someone other than its holder (``migctl release``, another client).
    ADMIN_RELEASE = "admin_release"
    #: Released by HTCondor's JOB_EXIT hook (``release_job``): the job's slot ended.
    JOB_EXIT = "job_exit"
    #: The reaper took it back: the holder process exited.
    HOLDER_GONE = "holder_gone"
    #: The reaper took it back: no heartbeat within ``reaper.heartbeat_timeout_s``.
    EXPIRED = "expired"
    #: Its MIG instance, MPS host or GPU disappeared (found by a resync or a restart).
    INSTANCE_GONE = "instance_gone"
    #: An NVML event (XID) lost the GPU work under it.
    GPU_LOST = "gpu_lost"
    #: Its MPS daemon could not be started.
    MPS_FAILED = "mps_failed"

    @property
    def stops_job(self) -> bool:
        """True for every end the job did not ask for."""
        return self is not LeaseEndReason.RELEASED

    @property
    def describe(self) -> str:
        """What happened, in a user's words (the wrapper's message and the job ad)."""
        return _DESCRIBE[self]


_DESCRIBE: Mapping[LeaseEndReason, str] = {
    LeaseEndReason.RELEASED: "the job released its GPU partition",
    LeaseEndReason.CANCELLED: "the request for a GPU partition was cancelled",
    LeaseEndReason.QUEUE_TIMEOUT: "no GPU partition became free in time",
    LeaseEndReason.FAILED: "migd could not prepare the GPU partition",
    LeaseEndReason.ADMIN_RELEASE: "an administrator released the job's GPU partition",
    LeaseEndReason.JOB_EXIT: "HTCondor's JOB_EXIT hook released the job's GPU partition",
    LeaseEndReason.HOLDER_GONE: "migd reclaimed the GPU partition: its holder process exited",
    LeaseEndReason.EXPIRED: "migd reclaimed the GPU partition: the lease expired "
    "(no heartbeat in time)",
    LeaseEndReason.INSTANCE_GONE: "the job's GPU partition disappeared from the GPU",
    LeaseEndReason.GPU_LOST: "the job's GPU failed and its GPU work is lost",
    LeaseEndReason.MPS_FAILED: "the MPS daemon of the job's GPU share could not start",
}


class LeaseEnded(TypedDict):
    """The lease-ended event as a ``release`` reply carries it (and a lease view's
    ``end_reason`` with ``state``): what the wrapper reads to tell an end it asked for
    from one it must stop the job for (:func:`end_reason_of`)."""

    state: str
    end_reason: str | None  # LeaseEndReason's value
    #: The lease had ended before this release (the reply says how it ended).
    already: NotRequired[bool]
    peak_used_mib: NotRequired[int | None]
    #: The lease's warning when its GPU work was lost: what wrappers older than
    #: ``end_reason`` read (they have HTCondor run the job again).
    gpu_lost: NotRequired[str]
    #: Why the lease ended, in words (an admin's ``--reason``, migd's own): the job's
    #: stop message says it also when the job ended before the wrapper's poll saw the
    #: lease go (a job that failed on its vanished partition).
    reason: NotRequired[str]


def end_reason_of(view: Mapping[str, Any]) -> LeaseEndReason | None:
    """The end reason in a lease view (``get_lease`` or a release reply), or ``None``.

    A daemon older than the field sends none; its views still say ``state``
    ``reclaimed`` (an end the job did not ask for), and its release reply has
    ``gpu_lost`` when the GPU failed under the lease.
    """
    raw = view.get("end_reason")
    if isinstance(raw, str):
        try:
            return LeaseEndReason(raw)
        except ValueError:
            # A newer daemon's reason this wrapper does not know: still not the job's.
            return LeaseEndReason.INSTANCE_GONE if raw else None
    if view.get("gpu_lost"):
        return LeaseEndReason.GPU_LOST
    if view.get("state") == "reclaimed":
        return LeaseEndReason.HOLDER_GONE
    return None


def signal_number(value: str | int | None, default: int = signal.SIGTERM) -> int:
    """A job ad's ``KillSig`` (``"SIGTERM"``, ``"TERM"``, ``"15"`` or 15) as a number;
    ``default`` when unset or not a signal this system has."""
    if value is None or value == "":
        return int(default)
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        number = int(value)
        # (real-time signals are valid numbers without a Signals member)
        valid = {int(s) for s in signal.valid_signals()} - {0}
        return number if number in valid else int(default)
    name = str(value).strip().upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return int(signal.Signals[name])
    except KeyError:
        return int(default)


@dataclass
class StopPlan:
    """Stopping a job whose lease migd took back, stepped with the time it is given.

    Args:
        kill_sig: the job's soft kill signal (HTCondor's ``kill_sig``).
        grace_s: seconds between that signal and SIGKILL.
    """

    kill_sig: int = int(signal.SIGTERM)
    grace_s: float = 10.0
    reason: LeaseEndReason | None = None
    detail: str = ""
    signalled_at: float | None = None
    killed: bool = False
    sent: list[int] = field(default_factory=list)

    def observe(self, view: Mapping[str, Any]) -> bool:
        """Look at the lease as migd sees it now; True when the job must stop (first
        time only: later views do not change the reason)."""
        if self.reason is not None:
            return False
        reason = end_reason_of(view)
        if reason is None or not reason.stops_job:
            return False
        self.reason = reason
        detail = None
        if reason is LeaseEndReason.GPU_LOST:  # the warning names the XID (gpu_lost: a reply)
            detail = view.get("warning") or view.get("gpu_lost")
        self.detail = str(detail or view.get("reason") or "")
        return True

    def step(self, now: float, job_running: bool) -> int | None:
        """The signal to send the job's process group at ``now`` (``None``: nothing)."""
        if self.reason is None or not job_running or self.killed:
            return None
        if self.signalled_at is None:
            self.signalled_at = now
            self.sent.append(self.kill_sig)
            return self.kill_sig
        if now - self.signalled_at >= self.grace_s:
            self.killed = True
            self.sent.append(int(signal.SIGKILL))
            return int(signal.SIGKILL)
        return None

    def wait_s(self, now: float) -> float | None:
        """How long the wrapper may wait for the job before the next :meth:`step`."""
        if self.signalled_at is None or self.killed:
            return None
        return max(0.0, self.signalled_at + self.grace_s - now)

    def message(self) -> str:
        """One line: what happened and what HTCondor does about it."""
        assert self.reason is not None
        # migd's own words end with advice for HTCondor ("; HTCondor should run it
        # again"): the wrapper's line says what happens instead.
        detail = " ".join(self.detail.split()).partition("; HTCondor")[0]
        if self.reason is LeaseEndReason.GPU_LOST and detail:
            return detail  # the warning names the XID and the GPU: it says it all
        return self.reason.describe + (f" ({detail})" if detail else "")


__all__ = ["LeaseEndReason", "StopPlan", "end_reason_of", "signal_number"]
