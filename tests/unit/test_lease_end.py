"""Why a lease ended, and the wrapper's decision to stop a job whose lease migd took back
(pure: views are dicts, time is passed in)."""

from __future__ import annotations

import signal

import pytest

from migd.core.lease_end import LeaseEndReason, StopPlan, end_reason_of, signal_number
from migd.core.leases import Lease, LeaseEvent, LeaseRequest, LeaseState

TERM, KILL = int(signal.SIGTERM), int(signal.SIGKILL)


def lease() -> Lease:
    return Lease("L1", LeaseRequest("1.0", 1000), owner_uid=1, owner_pid=2, created_s=0.0)


def active() -> Lease:
    x = lease()
    x.event(LeaseEvent.PLAN, 1.0)
    x.event(LeaseEvent.READY, 2.0)
    return x


@pytest.mark.parametrize(
    ("events", "end", "expected"),
    [
        ((LeaseEvent.RELEASE,), None, LeaseEndReason.CANCELLED),
        ((LeaseEvent.EXPIRE,), None, LeaseEndReason.QUEUE_TIMEOUT),
        ((LeaseEvent.PLAN, LeaseEvent.FAIL), None, LeaseEndReason.FAILED),
        ((LeaseEvent.PLAN, LeaseEvent.READY, LeaseEvent.RELEASE), None, LeaseEndReason.RELEASED),
        ((LeaseEvent.PLAN, LeaseEvent.READY, LeaseEvent.RECLAIM), None, LeaseEndReason.HOLDER_GONE),
        (
            (LeaseEvent.PLAN, LeaseEvent.READY, LeaseEvent.RELEASE),
            LeaseEndReason.ADMIN_RELEASE,
            LeaseEndReason.ADMIN_RELEASE,
        ),
        (
            (LeaseEvent.PLAN, LeaseEvent.READY, LeaseEvent.RECLAIM),
            LeaseEndReason.INSTANCE_GONE,
            LeaseEndReason.INSTANCE_GONE,
        ),
    ],
)
def test_every_end_has_a_reason(
    events: tuple[LeaseEvent, ...], end: LeaseEndReason | None, expected: LeaseEndReason
) -> None:
    x = lease()
    for i, event in enumerate(events):
        x.event(event, float(i), end=end if i == len(events) - 1 else None)
        if not x.state.terminal:
            assert x.end_reason is None
    assert x.state.terminal and x.end_reason is expected
    assert x.to_dict()["end_reason"] == expected.value


def test_a_gpu_lost_while_active_stays_the_reason_after_the_wrappers_release() -> None:
    x = active()
    x.warn("GPU lost: XID 79 ...", 3.0, end=LeaseEndReason.GPU_LOST)
    assert x.state is LeaseState.ACTIVE and x.end_reason is LeaseEndReason.GPU_LOST
    x.event(LeaseEvent.RELEASE, 4.0, end=LeaseEndReason.RELEASED)
    assert x.end_reason is LeaseEndReason.GPU_LOST


def test_only_the_jobs_own_release_does_not_stop_it() -> None:
    assert [r for r in LeaseEndReason if not r.stops_job] == [LeaseEndReason.RELEASED]
    for reason in LeaseEndReason:
        assert reason.describe  # every reason has words for the user


def test_views_of_every_daemon_age() -> None:
    assert end_reason_of({"state": "active", "end_reason": None}) is None
    assert end_reason_of({"end_reason": "admin_release"}) is LeaseEndReason.ADMIN_RELEASE
    # A newer daemon's reason this wrapper does not know is still not the job's.
    unknown = end_reason_of({"end_reason": "meteor_strike"})
    assert unknown is not None and unknown.stops_job
    # Daemons older than end_reason: a reclaimed state, or gpu_lost in a release reply.
    assert end_reason_of({"state": "reclaimed"}) is LeaseEndReason.HOLDER_GONE
    assert end_reason_of({"state": "released", "gpu_lost": "GPU lost: X"}) is (
        LeaseEndReason.GPU_LOST
    )
    assert end_reason_of({"state": "released"}) is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, TERM),
        ("", TERM),
        ("SIGINT", int(signal.SIGINT)),
        ("quit", int(signal.SIGQUIT)),
        ("10", int(signal.SIGUSR1)),
        (2, int(signal.SIGINT)),
        ("SIGNOPE", TERM),
        (999, TERM),
    ],
)
def test_the_job_ads_kill_sig(value: str | int | None, expected: int) -> None:
    assert signal_number(value) == expected


def test_nothing_happens_while_the_lease_is_the_jobs() -> None:
    plan = StopPlan(grace_s=5.0)
    for view in ({"state": "active"}, {"state": "active", "end_reason": None}):
        assert not plan.observe(view)
    assert plan.step(100.0, job_running=True) is None
    assert plan.wait_s(100.0) is None and plan.sent == []


def test_the_kill_signal_then_sigkill_after_the_grace_period() -> None:
    plan = StopPlan(kill_sig=int(signal.SIGINT), grace_s=5.0)
    assert plan.observe({"state": "released", "end_reason": "admin_release", "reason": "by uid 0"})
    assert plan.step(10.0, job_running=True) == int(signal.SIGINT)
    # Within the grace period: nothing more, and the wrapper waits what is left of it.
    for now in (10.0, 12.0, 14.99):
        assert plan.step(now, job_running=True) is None
        assert plan.wait_s(now) == pytest.approx(15.0 - now)
    assert plan.step(15.0, job_running=True) == KILL
    assert plan.step(16.0, job_running=True) is None  # killed once
    assert plan.sent == [int(signal.SIGINT), KILL]
    assert plan.message() == ("an administrator released the job's GPU partition (by uid 0)")


def test_a_job_that_exits_on_its_signal_is_not_killed() -> None:
    plan = StopPlan(grace_s=5.0)
    assert plan.observe({"state": "reclaimed", "end_reason": "expired", "reason": "no heartbeat"})
    assert plan.step(0.0, job_running=True) == TERM
    assert plan.step(6.0, job_running=False) is None
    assert plan.sent == [TERM]


def test_a_zero_grace_period_kills_at_the_next_step() -> None:
    plan = StopPlan(grace_s=0.0)
    assert plan.observe({"state": "reclaimed", "end_reason": "instance_gone"})
    assert plan.step(1.0, job_running=True) == TERM
    assert plan.wait_s(1.0) == 0.0
    assert plan.step(1.0, job_running=True) == KILL


def test_the_first_reason_stands_and_a_gpu_loss_speaks_for_itself() -> None:
    plan = StopPlan()
    warning = "GPU lost: XID 79 (GPU has fallen off the bus) on GPU 0: the job's GPU work is lost"
    view = {"state": "active", "end_reason": "gpu_lost", "warning": warning + "; HTCondor should"}
    assert plan.observe(view)
    assert not plan.observe({"state": "released", "end_reason": "admin_release"})
    assert plan.reason is LeaseEndReason.GPU_LOST
    assert plan.message() == warning


def test_the_jobs_own_release_is_not_a_stop() -> None:
    plan = StopPlan()
    assert not plan.observe({"state": "released", "end_reason": "released"})
    assert plan.step(0.0, job_running=True) is None
