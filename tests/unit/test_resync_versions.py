"""The books' version rule of ``NodeScheduler.resync``: a read older than the books of
its GPU is refused, whatever mutation came after it (issue 21, the resync race).

Every mutation a GPU's books can see is tried between a read and its apply; each must
make the read stale, and the stale apply must change nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from migd.core import catalog
from migd.core.gpus import InstanceStatus, ManagedGpu, MigState, Work
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.core.planner import CreateOp
from migd.core.policy import SchedulerPolicy
from migd.core.scheduler import NodeScheduler
from migd.core.states import state_space
from migd.errors import GpuError


def _node() -> NodeScheduler:
    geo = catalog.geometry("A100-40GB")
    gpu = ManagedGpu(0, "GPU-0000", "A100-40GB", "A100", geo.memory_mib, MigState(state_space(geo)))
    return NodeScheduler([gpu], SchedulerPolicy(idle_policy="keep"))


def _done(node: NodeScheduler, work: list[Work], now: float) -> None:
    for w in work:
        created = {
            op.start: (op.start + 1, f"MIG-{w.work_id}-{op.start}", op.profile.memory_mib)
            for op in w.ops
            if isinstance(op, CreateOp)
        }
        node.work_done(w, created, now, now)


def _read(node: NodeScheduler) -> list[tuple[object, int, int | None, str | None, int]]:
    return [
        (i.profile, i.start, i.gi_id, i.uuid, i.memory_mib)
        for i in node.gpus[0].instances
        if i.status is not InstanceStatus.CREATING
    ]


def _submit(node: NodeScheduler, name: str, mib: int) -> list[Work]:
    lease = Lease(name, LeaseRequest(f"job-{name}", mib), 1000, 1, 1.0)
    return node.submit(lease, 1.0, 1.0).work


def _grant(node: NodeScheduler) -> None:
    _done(node, _submit(node, "late", 4000), 2.0)


def _plan(node: NodeScheduler) -> None:
    _submit(node, "planned", 9000)


def _release(node: NodeScheduler) -> None:
    node.release("a", 2.0, 2.0)


def _fail(node: NodeScheduler) -> None:
    (work,) = _submit(node, "failing", 4000)
    node.work_failed(work, GpuError("no"), 2.0)


def _quarantine(node: NodeScheduler) -> None:
    assert node.quarantine("a", "processes outlived it") is not None


def _teardown(node: NodeScheduler) -> None:
    node.release("a", 2.0, 2.0)
    node.reset(0)


def _other_resync(node: NodeScheduler) -> None:
    node.resync(0, _read(node), set(), 2.0, read_at=node.books_version(0))


MUTATIONS: dict[str, Callable[[NodeScheduler], None]] = {
    "a create finished and was granted": _grant,
    "a create was planned": _plan,
    "a lease was released": _release,
    "work failed": _fail,
    "an instance was quarantined": _quarantine,
    "a teardown was planned": _teardown,
    "another resync was applied": _other_resync,
}


@pytest.mark.parametrize("what", sorted(MUTATIONS))
def test_a_read_older_than_the_books_changes_nothing(what: str) -> None:
    node = _node()
    _done(node, _submit(node, "a", 4000), 1.0)
    read_at, observed = node.books_version(0), _read(node)
    MUTATIONS[what](node)
    assert node.books_version(0) != read_at, f"{what}: the books' version did not change"
    before = [
        (i.start, i.profile.name, i.status, i.lease_ids, i.origin) for i in node.gpus[0].instances
    ]
    leases = {lease.lease_id: lease.state for lease in node.leases.values()}
    outcome = node.resync(0, observed, set(), 3.0, read_at=read_at)
    assert outcome.stale and not outcome.transitions and not outcome.work
    assert before == [
        (i.start, i.profile.name, i.status, i.lease_ids, i.origin) for i in node.gpus[0].instances
    ]
    assert leases == {lease.lease_id: lease.state for lease in node.leases.values()}


def test_the_race_of_the_issue_a_fresh_read_keeps_the_grant() -> None:
    """The same read, taken again after the grant, keeps the granted instance."""
    node = _node()
    _grant(node)
    (late,) = node.active_leases()
    outcome = node.resync(0, _read(node), set(), 3.0, read_at=node.books_version(0))
    assert not outcome.stale and late.state is LeaseState.ACTIVE


def test_a_fresh_read_leaves_a_queued_destroy_out_of_reach() -> None:
    """An instance whose destroy is queued stays DESTROYING through a resync that still
    sees it on the GPU (it used to become READY and could be handed out, then destroyed)."""
    node = _node()
    _done(node, _submit(node, "a", 4000), 1.0)
    node.release("a", 2.0, 2.0)
    (teardown,) = node.reset(0).work
    node.resync(0, _read(node), set(), 3.0, read_at=node.books_version(0))
    (inst,) = node.gpus[0].instances
    assert inst.status is InstanceStatus.DESTROYING
    assert node.submit(Lease("b", LeaseRequest("job-b", 4000), 1000, 1, 4.0), 4.0, 4.0).work
    assert inst.lease_id is None
    node.work_done(teardown, {}, 5.0, 5.0)
