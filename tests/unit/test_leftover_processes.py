"""An instance that still has processes is never handed out or destroyed (issue: a
job's child outlived its lease; the next lease reused the instance and ran out of
memory). The core's quarantine, and the daemon's record of instances released unchecked
(LeftoverChecks: the sampler's round, decided on the books, no NVML)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from migd.core import catalog
from migd.core.gpus import ManagedGpu, MigState, Origin, Work
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.core.planner import CreateOp, DestroyOp
from migd.core.policy import SchedulerPolicy
from migd.core.scheduler import NodeScheduler
from migd.core.states import state_space
from migd.daemon.leases.leftovers import LeftoverChecks

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


# -- the daemon's bookkeeping of instances released unchecked (LeftoverChecks) ----------------


class _Recorded:
    """The lease service's history, as LeftoverChecks reports to it."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str | None, dict[str, object]]] = []

    def record(self, event: str, lease: Lease | None = None, /, **data: object) -> None:
        self.rows.append((event, lease.lease_id if lease else None, data))


def _checks(node: NodeScheduler) -> tuple[LeftoverChecks, _Recorded]:
    recorded = _Recorded()
    ctx = SimpleNamespace(sched=node)
    return LeftoverChecks(ctx, None, recorded), recorded  # type: ignore[arg-type]


def _released(node: NodeScheduler, checks: LeftoverChecks, lease: Lease, now: float) -> str:
    """What the API's release does: mark the instance unchecked, then release."""
    assert lease.mig_uuid is not None
    checks.released(lease)
    _run(node, node.release(lease.lease_id, now, now).work, now)
    return lease.mig_uuid


def test_quarantine_idle_takes_only_an_idle_ready_instance() -> None:
    node = _node()
    lease = _grant(node, "A", 4000, 1.0)
    inst = node.gpus[0].instance_of("A")
    assert inst is not None and inst.uuid is not None
    assert node.quarantine_idle(0, inst.uuid, "x") is None  # a lease holds it
    _run(node, node.release("A", 2.0, 2.0).work, 2.0)
    assert node.quarantine_idle(0, "MIG-unknown", "x") is None
    version = node.books_version(0)
    assert node.quarantine_idle(0, inst.uuid, "processes outlived lease A: pid 7") == str(inst)
    assert inst.origin is Origin.UNEXPLAINED and inst.busy and "pid 7" in inst.note
    assert node.books_version(0) > version  # a resync read before this cannot undo it
    assert lease.state.terminal


def test_the_sampler_check_quarantines_an_idle_instance_and_names_the_lease() -> None:
    node = _node()
    checks, recorded = _checks(node)
    uuid = _released(node, checks, _grant(node, "A", 4000, 1.0), 2.0)
    asked = checks.plan(node.gpus[0])
    assert asked == {uuid: "A"}
    checks.apply(0, asked, {uuid: [4242]})
    [inst] = [i for i in node.gpus[0].instances if i.uuid == uuid]
    assert inst.origin is Origin.UNEXPLAINED and "lease A" in inst.note and "4242" in inst.note
    assert [(e, lid) for e, lid, _ in recorded.rows] == [("leftover_processes", "A")]
    assert not checks.unchecked and checks.plan(node.gpus[0]) == {}
    assert _grant(node, "B", 4000, 3.0).mig_uuid != uuid


def test_a_clean_listing_or_none_at_all_keeps_the_instance_in_use() -> None:
    node = _node()
    checks, recorded = _checks(node)
    uuid = _released(node, checks, _grant(node, "A", 4000, 1.0), 2.0)
    asked = checks.plan(node.gpus[0])
    checks.apply(0, asked, {uuid: None})  # NVML could not say: asked again next round
    assert checks.plan(node.gpus[0]) == asked
    checks.apply(0, asked, {uuid: []})
    assert not checks.unchecked and not recorded.rows
    assert _grant(node, "B", 4000, 3.0).mig_uuid == uuid  # reused


def test_a_sampler_answer_about_an_instance_leased_again_is_left_to_its_hand_out() -> None:
    node = _node()
    checks, recorded = _checks(node)
    uuid = _released(node, checks, _grant(node, "A", 4000, 1.0), 2.0)
    asked = checks.plan(node.gpus[0])
    second = _grant(node, "B", 4000, 3.0)  # granted while the sampler's listing ran
    assert second.mig_uuid == uuid
    checks.apply(0, asked, {uuid: [4242]})
    inst = node.gpus[0].instance_of("B")
    assert inst is not None and inst.origin is not Origin.UNEXPLAINED
    assert checks.unchecked[uuid].lease_id == "A" and not recorded.rows  # for the hand-out
    assert checks.plan(node.gpus[0]) == {}  # nothing to ask while a lease holds it


def test_an_answer_about_an_earlier_lease_is_not_applied_to_a_later_one() -> None:
    node = _node()
    checks, recorded = _checks(node)
    uuid = _released(node, checks, _grant(node, "A", 4000, 1.0), 2.0)
    asked = checks.plan(node.gpus[0])
    checks.unchecked.pop(uuid)  # B's hand-out checked it ...
    second = _grant(node, "B", 4000, 3.0)
    assert second.mig_uuid == uuid
    _released(node, checks, second, 4.0)  # ... and B ended there since
    checks.apply(0, asked, {uuid: [4242]})  # what the listing for A saw
    assert checks.unchecked[uuid].lease_id == "B" and not recorded.rows
    inst = next(i for i in node.gpus[0].instances if i.uuid == uuid)
    assert inst.origin is not Origin.UNEXPLAINED


def test_a_record_of_an_instance_that_is_gone_is_dropped() -> None:
    node = _node(idle_policy="destroy")
    checks, _ = _checks(node)
    uuid = _released(node, checks, _grant(node, "A", 4000, 1.0), 2.0)  # torn down at once
    assert all(i.uuid != uuid for i in node.gpus[0].instances)
    assert checks.plan(node.gpus[0]) == {} and not checks.unchecked
