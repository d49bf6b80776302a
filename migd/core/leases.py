"""A lease: its request, its record, and its lifecycle as an explicit transition table (pure).

A lease ties one job to one MIG instance or one MPS share::

    QUEUED --plan--> PREPARING --ready--> ACTIVE --release--> RELEASED
       |                |   \\--retry--> QUEUED        \\--reclaim--> RECLAIMED
       |                |--fail--> FAILED
       |--expire--> EXPIRED
       \\--release/reclaim--> CANCELLED  (also from PREPARING)

``heartbeat`` keeps an ACTIVE lease; terminal states accept nothing. Illegal
pairs raise :class:`IllegalLeaseTransition`, so a bug in the daemon cannot
silently free an instance that a job still uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NotRequired, TypedDict

from migd.core.gpus import GpuMode, RequestMode
from migd.core.lease_end import LeaseEndReason
from migd.errors import InvalidRequest, LeaseError


class LeaseState(StrEnum):
    QUEUED = "queued"
    PREPARING = "preparing"
    ACTIVE = "active"
    RELEASED = "released"
    RECLAIMED = "reclaimed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def holds_resources(self) -> bool:
        """True while the lease owns (or is creating) an instance or MPS share."""
        return self in (LeaseState.PREPARING, LeaseState.ACTIVE)


class LeaseEvent(StrEnum):
    PLAN = "plan"
    READY = "ready"
    RETRY = "retry"
    FAIL = "fail"
    RELEASE = "release"
    RECLAIM = "reclaim"
    EXPIRE = "expire"
    HEARTBEAT = "heartbeat"


TERMINAL = frozenset(
    {
        LeaseState.RELEASED,
        LeaseState.RECLAIMED,
        LeaseState.EXPIRED,
        LeaseState.CANCELLED,
        LeaseState.FAILED,
    }
)

S, E = LeaseState, LeaseEvent
TRANSITIONS: Mapping[tuple[LeaseState, LeaseEvent], LeaseState] = {
    (S.QUEUED, E.PLAN): S.PREPARING,
    (S.QUEUED, E.EXPIRE): S.EXPIRED,
    (S.QUEUED, E.RELEASE): S.CANCELLED,
    (S.QUEUED, E.RECLAIM): S.CANCELLED,
    (S.PREPARING, E.READY): S.ACTIVE,
    (S.PREPARING, E.RETRY): S.QUEUED,
    (S.PREPARING, E.FAIL): S.FAILED,
    (S.PREPARING, E.RELEASE): S.CANCELLED,
    (S.PREPARING, E.RECLAIM): S.CANCELLED,
    (S.ACTIVE, E.HEARTBEAT): S.ACTIVE,
    (S.ACTIVE, E.RELEASE): S.RELEASED,
    (S.ACTIVE, E.RECLAIM): S.RECLAIMED,
}
del S, E


# Why a lease ended when its caller names no reason: the end the transition means.
DEFAULT_END: Mapping[LeaseState, LeaseEndReason] = {
    LeaseState.RELEASED: LeaseEndReason.RELEASED,
    LeaseState.RECLAIMED: LeaseEndReason.HOLDER_GONE,
    LeaseState.EXPIRED: LeaseEndReason.QUEUE_TIMEOUT,
    LeaseState.CANCELLED: LeaseEndReason.CANCELLED,
    LeaseState.FAILED: LeaseEndReason.FAILED,
}


class IllegalLeaseTransition(LeaseError):
    code = "illegal_lease_transition"


def next_state(state: LeaseState, event: LeaseEvent) -> LeaseState:
    """The state after ``event``.

    Raises:
        IllegalLeaseTransition: ``event`` is not allowed in ``state``.
    """
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalLeaseTransition(
            f"a {state.value} lease cannot {event.value}",
            hint="`migctl leases` shows the lease's state",
            state=state.value,
            event=event.value,
        ) from None


class LeaseView(TypedDict):
    """A lease as the API shows it (``Lease.to_dict``): the ``lease`` and ``get_lease``
    replies, ``migctl leases``, the state db's rows. ``env`` is left out for a reader
    who is neither the owner nor an admin."""

    lease_id: str
    job_id: str
    slot: str
    state: str
    owner_uid: int
    owner_pid: int
    requested_mib: int
    min_compute: int
    requested_mode: str
    mode: str | None
    gpu: int | None
    gpu_uuid: str | None
    profile: str | None
    start: int | None
    mig_uuid: str | None
    memory_limit_mib: int | None
    mps_clients: int
    mps_thread_percentage: int | None
    warning: str
    warning_s: float | None
    end_reason: str | None  # LeaseEndReason's value once the lease ended, else None
    env: NotRequired[dict[str, str]]
    created_s: float
    updated_s: float
    deadline_s: float | None
    reason: str
    decision: dict[str, Any] | None


@dataclass(frozen=True)
class LeaseRequest:
    """A validated lease request (the API layer builds it)."""

    job_id: str
    memory_mib: int
    slot: str = ""
    min_compute: int = 0
    profile: str | None = None
    mode: RequestMode = "auto"
    gpu_uuids: tuple[str, ...] | None = None  # restrict to these GPUs (prefix match)
    wait_s: float | None = 0.0  # 0: do not queue; None: wait forever
    # MPS: CUDA client processes the job runs (each gets the pinned limit; accounted as
    # memory x clients), and an explicit CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (1-100; else
    # derived from min_compute, see NodeScheduler.mps_thread_percentage).
    mps_clients: int = 1
    mps_thread_percentage: int | None = None

    def __post_init__(self) -> None:
        if self.memory_mib <= 0 and not self.profile:
            raise InvalidRequest(
                "a lease needs gpu_memory_mib > 0 or a profile",
                hint="ask for the GPU memory the job needs, e.g. request_VRAM = 10240",
            )
        if self.min_compute < 0:
            raise InvalidRequest("min_compute must not be negative")
        if self.wait_s is not None and self.wait_s < 0:
            raise InvalidRequest("wait_s must not be negative")
        if self.mps_clients < 1:
            raise InvalidRequest(
                f"mps_clients must be at least 1, got {self.mps_clients}",
                hint="declare how many CUDA processes the job runs (default 1)",
            )
        if self.mps_thread_percentage is not None and not 1 <= self.mps_thread_percentage <= 100:
            raise InvalidRequest(
                f"mps_thread_percentage must be 1-100, got {self.mps_thread_percentage}"
            )


@dataclass
class Lease:
    """One job's claim on a partition, from request to release."""

    lease_id: str
    request: LeaseRequest
    owner_uid: int
    owner_pid: int
    created_s: float
    owner_start_s: float | None = None
    state: LeaseState = LeaseState.QUEUED
    updated_s: float = 0.0
    gpu: int | None = None
    gpu_uuid: str | None = None
    mode: GpuMode | None = None  # granted: MIG, MPS or EXCLUSIVE (never OFF)
    profile: str | None = None
    start: int | None = None
    mig_uuid: str | None = None
    memory_limit_mib: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    decision: dict[str, Any] | None = None
    reason: str = ""
    heartbeat_s: float | None = None  # wall clock, for display and the record
    # Monotonic time of the last sign of life (grant, heartbeat; a restored lease: when
    # the reaper first sees it). The reaper judges silence by it, never by the wall
    # clock, which an NTP step or an admin's `date` moves; not stored (another boot's
    # monotonic clock means nothing).
    alive_mono_s: float | None = field(default=None, compare=False)
    deadline_s: float | None = None  # wall clock, for display
    version: int = 0  # bumped on every change, so callers persist only what changed
    # MPS: the CUDA_MPS_ACTIVE_THREAD_PERCENTAGE granted (explicit or from min_compute).
    mps_thread_percentage: int | None = None
    # Something that hit the lease while it was active and that its job should know
    # (e.g. its MPS server was restarted, so its CUDA clients died); shown by migctl.
    warning: str = ""
    warning_s: float | None = None
    # Why it ended (typed; docs/api.md, "Why a lease ended"). Set when it ends, or
    # earlier when migd decided its job must stop while it is still active (gpu_lost):
    # an end set first is kept.
    end_reason: LeaseEndReason | None = None

    def __post_init__(self) -> None:
        if self.mode is not None:  # the state db and JSON give the value
            self.mode = GpuMode(self.mode)
        if self.end_reason is not None:
            self.end_reason = LeaseEndReason(self.end_reason)

    @property
    def mps_device_uuid(self) -> str | None:
        """The MPS device an ``mps`` lease runs on: its MIG instance (MPS inside MIG) or
        its whole GPU."""
        if self.mode is not GpuMode.MPS:
            return None
        return self.mig_uuid or self.gpu_uuid

    def warn(self, message: str, now_s: float, *, end: LeaseEndReason | None = None) -> None:
        """Flag the lease (kept while it lives and in its record); ``end``: its job must
        stop for this reason (the lease ends when the job's wrapper releases it)."""
        self.warning, self.warning_s = message, now_s
        if end is not None and self.end_reason is None:
            self.end_reason = end
        self.version += 1

    def event(
        self,
        event: LeaseEvent,
        now_s: float,
        reason: str = "",
        *,
        end: LeaseEndReason | None = None,
    ) -> None:
        self.state = next_state(self.state, event)
        self.updated_s = now_s
        self.version += 1
        if reason:
            self.reason = reason
        if self.state.terminal and self.end_reason is None:
            self.end_reason = end or DEFAULT_END[self.state]

    def to_dict(self) -> LeaseView:
        return {
            "lease_id": self.lease_id,
            "job_id": self.request.job_id,
            "slot": self.request.slot,
            "state": self.state.value,
            "owner_uid": self.owner_uid,
            "owner_pid": self.owner_pid,
            "requested_mib": self.request.memory_mib,
            "min_compute": self.request.min_compute,
            "requested_mode": self.request.mode,
            "mode": self.mode,
            "gpu": self.gpu,
            "gpu_uuid": self.gpu_uuid,
            "profile": self.profile,
            "start": self.start,
            "mig_uuid": self.mig_uuid,
            "memory_limit_mib": self.memory_limit_mib,
            "mps_clients": self.request.mps_clients,
            "mps_thread_percentage": self.mps_thread_percentage,
            "warning": self.warning,
            "warning_s": self.warning_s,
            "end_reason": self.end_reason.value if self.end_reason else None,
            "env": dict(self.env),
            "created_s": self.created_s,
            "updated_s": self.updated_s,
            "deadline_s": self.deadline_s,
            "reason": self.reason,
            "decision": self.decision,
        }
