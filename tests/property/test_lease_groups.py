"""Lease groups (one job on several GPUs): all or none, over random nodes and queues.

Whatever the node's GPUs already hold, a group is either placed whole (every member
holds a partition, each on a GPU of its own unless its request pins it to a GPU
another member is pinned to) or not at all: while it waits, no member holds anything
and the GPUs' books are exactly as before it was tried.
"""

from __future__ import annotations

import contextlib
import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from migd.core import catalog
from migd.core.gpus import ManagedGpu, MigState
from migd.core.groups import merge_environments
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.core.policy import SchedulerPolicy
from migd.core.scheduler import NodeScheduler, Outcome
from migd.core.states import state_space
from migd.errors import NoCapacity, RequestTooLarge

MODELS = ["A30-24GB", "A100-40GB", "H100-80GB"]
_ids = itertools.count(1)


def make_node(models: list[str], idle: str = "keep") -> NodeScheduler:
    gpus = []
    for n, model in enumerate(models):
        geo = catalog.geometry(model)
        gpus.append(
            ManagedGpu(n, f"GPU-{n:04d}", model, model, geo.memory_mib, MigState(state_space(geo)))
        )
    return NodeScheduler(gpus, SchedulerPolicy(idle_policy=idle))


def lease(memory: int, *, gpus: tuple[str, ...] | None = None, wait: float | None = 0.0) -> Lease:
    n = next(_ids)
    request = LeaseRequest(job_id=f"job{n}", memory_mib=memory, gpu_uuids=gpus, wait_s=wait)
    return Lease(f"L{n}", request, owner_uid=1000, owner_pid=100 + n, created_s=0.0)


def finish(node: NodeScheduler, outcome: Outcome) -> None:
    """Complete every piece of work (and the work completions make), as NVML would."""
    todo = list(outcome.work)
    while todo:
        work = todo.pop(0)
        if not node.work_is_current(work):
            continue
        created = {
            op.start: (op.start, f"MIG-{work.gpu}-{op.start}-{next(_ids)}", op.profile.memory_mib)
            for op in work.ops
            if type(op).__name__ == "CreateOp"
        }
        todo.extend(node.work_done(work, created, 0.0, 0.0).work)


def books(node: NodeScheduler) -> list[object]:
    return [
        (g.index, [(i.profile.name, i.start, i.status, i.lease_id) for i in g.instances])
        for g in node.gpus.values()
    ]


def check_group(node: NodeScheduler, members: list[Lease], pins: list[str] | None) -> None:
    """All or none; one GPU each unless pinned there together."""
    holding = [m for m in members if m.state.holds_resources]
    assert len(holding) in (0, len(members)), [m.state for m in members]
    if holding:
        gpus = [m.gpu for m in members]
        if pins is None:
            assert len(set(gpus)) == len(gpus), gpus
        else:
            assert gpus == [int(p[-4:]) for p in pins], (gpus, pins)
        for m in members:
            owners = [
                i for g in node.gpus.values() for i in g.instances if i.lease_id == m.lease_id
            ]
            assert len(owners) == 1 and owners[0].memory_mib >= m.request.memory_mib


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    models=st.lists(st.sampled_from(MODELS), min_size=2, max_size=4),
    idle=st.sampled_from(["keep", "destroy"]),
    blockers=st.lists(st.integers(1_000, 40_000), max_size=6),
    size=st.integers(2, 4),
    memory=st.integers(1_000, 40_000),
    pin=st.booleans(),
    same_gpu=st.booleans(),
    release_order=st.permutations(range(6)),
)
def test_a_group_is_placed_whole_or_not_at_all(
    models: list[str],
    idle: str,
    blockers: list[int],
    size: int,
    memory: int,
    pin: bool,
    same_gpu: bool,
    release_order: list[int],
) -> None:
    node = make_node(models, idle)
    held: list[Lease] = []
    for mib in blockers:
        one = lease(mib)
        with contextlib.suppress(RequestTooLarge):
            outcome = node.submit(one, 0.0, 0.0)
            finish(node, outcome)
            if one.state is LeaseState.ACTIVE:
                held.append(one)
    pins: list[str] | None = None
    if pin:
        first = f"GPU-{0:04d}"
        pins = [first] * size if same_gpu else [f"GPU-{i % len(models):04d}" for i in range(size)]
        if not same_gpu and size > len(models):
            pins = None  # as many GPUs as HTCondor could assign: fewer than the members
    members = [lease(memory, gpus=(p,) if pins else None, wait=None) for p in pins or [None] * size]
    before = books(node)
    try:
        outcome = node.submit_group(members, 0.0, 0.0)
    except RequestTooLarge:
        assert books(node) == before  # refused outright: nothing changed
        return
    check_group(node, members, pins)
    if members[0].state is LeaseState.QUEUED:
        assert all(m.state is LeaseState.QUEUED for m in members)
        assert books(node) == before  # the trial left the books as they were
        assert outcome.work == []
    finish(node, outcome)
    check_group(node, members, pins)
    # Capacity comes back one lease at a time: the group stays whole or waiting.
    for i in release_order:
        if i >= len(held):
            continue
        finish(node, node.release(held[i].lease_id, 1.0, 1.0))
        check_group(node, members, pins)
    if all(m.state is LeaseState.ACTIVE for m in members):
        env = merge_environments(members)
        assert env["CUDA_VISIBLE_DEVICES"].split(",") == [m.mig_uuid for m in members]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models=st.lists(st.sampled_from(MODELS), min_size=2, max_size=3), size=st.integers(2, 3))
def test_a_group_that_cannot_wait_is_refused_whole(models: list[str], size: int) -> None:
    node = make_node(models)
    # GPU 0 full: a group needing every GPU cannot be placed now.
    full = lease(catalog.geometry(models[0]).memory_mib - 2_000, gpus=("GPU-0000",))
    finish(node, node.submit(full, 0.0, 0.0))
    members = [lease(1_000, gpus=(f"GPU-{i:04d}",)) for i in range(len(models))][:size]
    if members[0].request.gpu_uuids != ("GPU-0000",) or full.state is not LeaseState.ACTIVE:
        return
    before = books(node)
    outcome = node.submit_group(members, 0.0, 0.0)
    assert isinstance(outcome.refusal, NoCapacity)
    assert books(node) == before
    assert all(m.lease_id not in node.leases for m in members)


def test_a_waiting_group_is_placed_when_the_last_gpu_frees() -> None:
    node = make_node(["A100-40GB", "A100-40GB"])
    blocker = lease(39_000, gpus=("GPU-0001",))
    finish(node, node.submit(blocker, 0.0, 0.0))
    assert blocker.state is LeaseState.ACTIVE
    members = [lease(10_000, gpus=(f"GPU-{i:04d}",), wait=None) for i in range(2)]
    outcome = node.submit_group(members, 0.0, 0.0)
    # GPU 0 is free, yet its member takes nothing while GPU 1 is busy.
    assert [m.state for m in members] == [LeaseState.QUEUED] * 2
    assert node.gpus[0].instances == [] and outcome.work == []
    finish(node, node.release(blocker.lease_id, 1.0, 1.0))
    assert [m.state for m in members] == [LeaseState.ACTIVE] * 2
    assert [m.gpu for m in members] == [0, 1]
    assert node.group_of(members[1].lease_id) == (members[0].lease_id, members[1].lease_id)


def test_a_waiting_group_ends_whole() -> None:
    """Its client gone, or its deadline passed: every member ends, none is left queued."""
    node = make_node(["A30-24GB", "A30-24GB"])
    blocker = lease(23_000, gpus=("GPU-0001",))
    finish(node, node.submit(blocker, 0.0, 0.0))
    members = [lease(5_000, gpus=(f"GPU-{i:04d}",), wait=None) for i in range(2)]
    node.submit_group(members, 0.0, 0.0)
    node.release(members[1].lease_id, 1.0, 1.0, reason="client disconnected")
    assert [m.state for m in members] == [LeaseState.CANCELLED] * 2
    assert len(node.queue) == 0
    timed = [lease(5_000, gpus=(f"GPU-{i:04d}",), wait=5.0) for i in range(2)]
    node.submit_group(timed, 2.0, 2.0)
    node.expire(10.0, 10.0)
    assert [m.state for m in timed] == [LeaseState.EXPIRED] * 2
    assert len(node.queue) == 0


def test_a_group_larger_than_the_node_is_refused() -> None:
    node = make_node(["A100-40GB", "A100-40GB"])
    try:
        node.submit_group([lease(1_000) for _ in range(3)], 0.0, 0.0)
    except RequestTooLarge as exc:
        assert "3 GPUs" in exc.message
    else:
        raise AssertionError("a 3-GPU job on a 2-GPU node was not refused")


def test_a_failed_member_placement_fails_it_rather_than_requeue_it_alone() -> None:
    node = make_node(["A100-40GB", "A100-40GB"])
    members = [lease(10_000, gpus=(f"GPU-{i:04d}",), wait=None) for i in range(2)]
    outcome = node.submit_group(members, 0.0, 0.0)
    first, second = outcome.work
    finish(node, Outcome(work=[first]))
    node.work_failed(second, RuntimeError("NVML said no"), 0.0)
    assert [m.state for m in members] == [LeaseState.ACTIVE, LeaseState.FAILED]
    assert len(node.queue) == 0  # never back in the queue alone
