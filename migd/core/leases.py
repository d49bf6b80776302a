"""Lease lifecycle: an explicit transition table (pure).

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
from enum import StrEnum

from migd.errors import LeaseError


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
