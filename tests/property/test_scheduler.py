"""NodeScheduler invariants under random submit/release/complete/fail sequences."""

from __future__ import annotations

import contextlib
import itertools

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from migd.core import catalog
from migd.core.gpus import InstanceStatus, ManagedGpu, MigState, Origin, Work
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.core.planner import CreateOp, DestroyOp
from migd.core.policy import SchedulerPolicy
from migd.core.queueing import QueuePolicy
from migd.core.scheduler import NodeScheduler
from migd.core.states import state_space
from migd.errors import InsufficientResources, RequestTooLarge

MODELS = ["A30-24GB", "A100-40GB", "H100-80GB"]


def make_node(models: list[str], policy: SchedulerPolicy) -> NodeScheduler:
    gpus = []
    for n, model in enumerate(models):
        geo = catalog.geometry(model)
        gpus.append(
            ManagedGpu(n, f"GPU-{n:04d}", model, model, geo.memory_mib, MigState(state_space(geo)))
        )
    return NodeScheduler(gpus, policy)


def check_invariants(node: NodeScheduler, destroyed_busy: list[str]) -> None:
    assert not destroyed_busy, destroyed_busy
    for gpu in node.gpus.values():
        assert gpu.space is not None
        live = [i for i in gpu.instances if i.status is not InstanceStatus.DESTROYING]
        gpu.space.key_of((i.profile, i.start) for i in live)  # a valid state
        for inst in gpu.instances:
            if inst.lease_id is not None:
                lease = node.leases.get(inst.lease_id)
                assert lease is not None and lease.state.holds_resources
                assert (lease.gpu, lease.start) == (gpu.index, inst.start)
    for lease in node.leases.values():
        if lease.state.holds_resources and lease.mode == "mig":
            owners = [
                i for g in node.gpus.values() for i in g.instances if i.lease_id == lease.lease_id
            ]
            assert len(owners) == 1
        if lease.state is LeaseState.ACTIVE and lease.mode == "mig":
            assert lease.env["CUDA_VISIBLE_DEVICES"].startswith("MIG-")
    for item in node.queue:
        assert node.leases[item.payload].state is LeaseState.QUEUED
    # and no queued lease is lost outside the queue (a failed placement goes back in)
    queued = {k for k, v in node.leases.items() if v.state is LeaseState.QUEUED}
    assert queued == {item.payload for item in node.queue}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    models=st.lists(st.sampled_from(MODELS), min_size=1, max_size=4),
    queue=st.sampled_from(list(QueuePolicy)),
    idle=st.sampled_from(["keep", "destroy", "timeout"]),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["submit", "release", "complete", "fail", "idle", "expire"]),
            st.integers(1, 100_000),
            st.integers(0, 10**6),
        ),
        min_size=1,
        max_size=60,
    ),
)
# Found by Hypothesis: a cancelled lease's create work made stale by a failed destroy
# left its queue entry behind for good.
@example(
    models=["A30-24GB"],
    queue=QueuePolicy.FIFO,
    idle="destroy",
    steps=[
        ("submit", 11972, 0),
        ("submit", 1, 1),
        ("complete", 1, 0),
        ("release", 1, 0),
        ("release", 1, 0),
        ("fail", 1, 0),
        ("complete", 1, 0),
    ],
)
def test_scheduler_invariants(
    models: list[str], queue: QueuePolicy, idle: str, steps: list[tuple[str, int, int]]
) -> None:
    node = make_node(models, SchedulerPolicy(queue=queue, idle_policy=idle, idle_timeout_s=5))  # type: ignore[arg-type]
    pending: list[Work] = []
    ids = itertools.count()
    gi_ids = itertools.count(1)
    now = 0.0
    destroyed_busy: list[str] = []

    def take(work: list[Work]) -> None:
        for w in work:
            gpu = node.gpus[w.gpu]
            for op in w.ops:
                if isinstance(op, DestroyOp):
                    inst = gpu.instance_at(op.start)
                    assert inst is not None
                    if inst.lease_id is not None or inst.origin is Origin.UNEXPLAINED:
                        destroyed_busy.append(str(inst))
            pending.append(w)

    for action, size, pick in steps:
        now += 1.0
        if action == "submit":
            wait_s = 0.0 if pick % 3 == 0 else 30.0
            lease = Lease(f"L{next(ids)}", LeaseRequest("job", size, wait_s=wait_s), 1000, 1, now)
            # A refusal's outcome has what its pass started for others: it still runs.
            with contextlib.suppress(RequestTooLarge):
                take(node.submit(lease, now, now).work)
        elif action == "release":
            live = [lease for lease in node.leases.values() if not lease.state.terminal]
            if live:
                take(node.release(live[pick % len(live)].lease_id, now, now).work)
        elif action in ("complete", "fail") and pending:
            work = pending.pop(0)
            if action == "complete":
                created = {
                    op.start: (next(gi_ids), f"MIG-{op.start}-{now}", op.profile.memory_mib)
                    for op in work.ops
                    if isinstance(op, CreateOp)
                }
                take(node.work_done(work, created, now, now).work)
            else:
                node.work_failed(work, InsufficientResources("injected"), now)
                gpu = node.gpus[work.gpu]
                observed = [
                    (i.profile, i.start, i.gi_id, i.uuid, i.memory_mib)
                    for i in gpu.instances
                    if i.status is InstanceStatus.READY
                ]
                node.resync(work.gpu, observed, set(), now, read_at=node.books_version(work.gpu))
                take(node.schedule(now, now).work)
        elif action == "idle":
            take(node.idle_teardown(now, now).work)
        elif action == "expire":
            later = now + pick % 60
            take(node.expire(later, later).work)
        check_invariants(node, destroyed_busy)
        # Nothing waits forever: a lease being prepared has its work on its way ...
        waiting_on = {w.lease_id for w in pending}
        for lease in node.leases.values():
            if lease.state is LeaseState.PREPARING:
                assert lease.lease_id in waiting_on, f"{lease.lease_id} lost its work"
        # ... and the queue keeps a placed request's entry only while its work is out.
        assert set(node._placed_items) <= waiting_on
