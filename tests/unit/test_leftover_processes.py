"""An instance that still has processes is never handed out or destroyed (issue: a
job's child outlived its lease; the next lease reused the instance and ran out of
memory). Core only: the daemon checks the processes and calls quarantine/resync."""

from __future__ import annotations

import itertools

from migd.core import catalog
from migd.core.gpus import ManagedGpu, MigState, Origin, Work
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.core.planner import CreateOp, DestroyOp
from migd.core.policy import SchedulerPolicy
from migd.core.scheduler import NodeScheduler
from migd.core.states import state_space

_gi = itertools.count(1)


def _node(idle_policy: str = "keep") -> NodeScheduler:
    geo = catalog.geometry("A100-40GB")
    gpu = ManagedGpu(0, "GPU-0000", "A100-40GB", "A100", geo.memory_mib, MigState(state_space(geo)))
    return NodeScheduler([gpu], SchedulerPolicy(idle_policy=idle_policy, idle_timeout_s=5))  # type: ignore[arg-type]


def _run(node: NodeScheduler, work: list[Work], now: float) -> list[Work]:
    """Complete grant work as NVML would; return what destroyed anything."""
    destroys = []
    for w in work:
        if any(isinstance(op, DestroyOp) for op in w.ops):
            destroys.append(w)
        created = {
            op.start: (next(_gi), f"MIG-{op.start}-{now}", op.profile.memory_mib)
            for op in w.ops
            if isinstance(op, CreateOp)
        }
        node.work_done(w, created, now, now)
    return destroys


def _grant(node: NodeScheduler, name: str, mib: int, now: float) -> Lease:
    lease = Lease(name, LeaseRequest(f"job-{name}", mib), 1000, 1, now)
    _run(node, node.submit(lease, now, now).work, now)
    assert lease.state is LeaseState.ACTIVE
    return lease


def _observed(node: NodeScheduler) -> list[tuple[object, int, int | None, str | None, int]]:
    return [(i.profile, i.start, i.gi_id, i.uuid, i.memory_mib) for i in node.gpus[0].instances]


def test_a_quarantined_instance_is_not_reused_until_its_processes_exit() -> None:
    node = _node()
    first = _grant(node, "A", 4000, 1.0)
    inst = node.gpus[0].instance_of("A")
    assert inst is not None and inst.uuid is not None
    assert node.quarantine("A", "processes outlived lease A: pid 4242") == str(inst)
    _run(node, node.release("A", 2.0, 2.0).work, 2.0)
    assert first.state.terminal and inst.busy and inst.origin is Origin.UNEXPLAINED
    second = _grant(node, "B", 4000, 3.0)
    assert second.start != inst.start  # a fresh instance, not the one with processes
    # idle teardown never destroys it either
    assert not any(
        isinstance(op, DestroyOp) and op.start == inst.start
        for w in node.idle_teardown(100.0, 100.0).work
        for op in w.ops
    )
    node.resync(0, _observed(node), {inst.uuid}, 101.0, read_at=node.books_version(0))
    assert inst.origin is Origin.UNEXPLAINED  # still in use
    node.resync(0, _observed(node), set(), 102.0, read_at=node.books_version(0))
    assert inst.origin is Origin.ADOPTED and not inst.busy  # the processes exited
    third = _grant(node, "C", 4000, 103.0)
    assert third.start == inst.start  # usable again


def test_a_resync_quarantines_an_idle_instance_that_has_processes() -> None:
    # The running path: the lease ended and its instance was idle when released; a
    # process shows up on it later (a child the release check could not see yet).
    node = _node()
    _grant(node, "A", 4000, 1.0)
    inst = node.gpus[0].instance_of("A")
    assert inst is not None and inst.uuid is not None
    _run(node, node.release("A", 2.0, 2.0).work, 2.0)
    assert not inst.busy
    resynced = node.resync(0, _observed(node), {inst.uuid}, 3.0, read_at=node.books_version(0))
    assert inst.busy and inst.origin is Origin.UNEXPLAINED
    assert any("without a migd lease" in n for n in resynced.notes)
    assert _grant(node, "B", 4000, 4.0).start != inst.start
    assert not any(
        isinstance(op, DestroyOp) and op.start == inst.start
        for w in node.idle_teardown(100.0, 100.0).work
        for op in w.ops
    )


def test_the_destroy_policy_keeps_a_quarantined_instance() -> None:
    node = _node(idle_policy="destroy")
    _grant(node, "A", 4000, 1.0)
    inst = node.gpus[0].instance_of("A")
    assert inst is not None
    node.quarantine("A", "processes outlived lease A")
    work = node.release("A", 2.0, 2.0).work
    assert not any(isinstance(op, DestroyOp) for w in work for op in w.ops)
    assert inst in node.gpus[0].instances and inst.busy


def test_quarantine_ignores_leases_without_a_mig_instance() -> None:
    node = _node()
    assert node.quarantine("nope", "x") is None
