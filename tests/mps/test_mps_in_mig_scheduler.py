"""MPS inside MIG instances and MPS request fields, in the scheduler (no I/O)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from migd.core import catalog
from migd.core.gpus import InstanceStatus, ManagedGpu, MigState, MpsState, Origin, Work
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.core.planner import CreateOp, DestroyOp
from migd.core.policy import SchedulerPolicy
from migd.core.scheduler import NodeScheduler
from migd.core.states import state_space
from migd.errors import InsufficientResources, InvalidRequest, RequestTooLarge


def mig_gpu(index: int = 0, model: str = "A100-40GB", **kw: object) -> ManagedGpu:
    geo = catalog.geometry(model)
    return ManagedGpu(
        index,
        f"GPU-{index:04d}",
        model,
        model,
        geo.memory_mib,
        MigState(state_space(geo), **kw),  # type: ignore[arg-type]
        compute_slices=geo.compute_slices,
    )


def lease(
    lease_id: str, memory_mib: int, *, uid: int = 1000, mode: str = "auto", **kw: object
) -> Lease:
    request = LeaseRequest("job", memory_mib, mode=mode, wait_s=30.0, **kw)  # type: ignore[arg-type]
    return Lease(lease_id, request, uid, 1, 0.0)


def complete(
    node: NodeScheduler,
    work: list[Work],
    now: float = 1.0,
    follow: Callable[[list[Work]], None] | None = None,
) -> dict[int, str]:
    """Finish work as the daemon would; returns start -> new MIG UUID. ``follow`` gets
    the work each completion's outcome starts for queued requests."""
    uuids: dict[int, str] = {}
    for w in work:
        created = {
            op.start: (op.start + 1, f"MIG-{w.gpu}-{op.start}-{now}", op.profile.memory_mib)
            for op in w.ops
            if isinstance(op, CreateOp)
        }
        outcome = node.work_done(w, created, now, now)
        if follow is not None:
            follow(outcome.work)
        uuids.update({start: c[1] for start, c in created.items()})
    return uuids


def test_small_requests_share_one_mps_instance_with_a_proportional_client_cap() -> None:
    gpu = mig_gpu(mps_in_mig=True)
    node = NodeScheduler([gpu], SchedulerPolicy(mps_reserve_mib=512))
    first = lease("a", 1500)
    out = node.submit(first, 0.0, 0.0)
    assert first.state is LeaseState.PREPARING and first.mode == "mps"
    (create,) = [op for w in out.work for op in w.ops]
    assert isinstance(create, CreateOp) and create.profile.name == "1g.5gb"
    second = lease("b", 2000)
    assert node.submit(second, 0.5, 0.5).work == []  # admitted onto the host being made
    assert second.state is LeaseState.PREPARING
    uuids = complete(node, out.work)
    (host,) = gpu.instances
    assert first.state is LeaseState.ACTIVE and second.state is LeaseState.ACTIVE
    assert first.mig_uuid == second.mig_uuid == host.uuid == uuids[host.start]
    assert first.env["CUDA_VISIBLE_DEVICES"] == host.uuid
    assert first.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1500M"
    assert host.mps_pool is not None and host.busy
    assert host.mps_pool.max_clients == 48 * 1 // 7 == 6
    assert host.mps_pool.capacity_mib == host.memory_mib - 512
    # A third one that does not fit the host's unpinned memory gets a second host.
    third = lease("c", 1500)
    out3 = node.submit(third, 2.0, 2.0)
    assert [op for w in out3.work for op in w.ops if isinstance(op, CreateOp)]
    complete(node, out3.work, 2.0)
    assert third.mig_uuid not in (None, host.uuid)


def test_a_request_as_big_as_an_instance_gets_its_own_instance() -> None:
    gpu = mig_gpu(mps_in_mig=True)
    node = NodeScheduler([gpu])
    big = lease("big", 4000)  # 1g.5gb is the smallest: not smaller than it
    node.submit(big, 0.0, 0.0)
    assert big.mode == "mig"


def test_mode_mps_on_a_mig_gpu_needs_mps_in_mig() -> None:
    with pytest.raises(InvalidRequest, match="mode=mps"):
        NodeScheduler([mig_gpu()]).submit(lease("m", 1000, mode="mps"), 0.0, 0.0)
    node = NodeScheduler([mig_gpu(mps_in_mig=True, mps_profile="3g.20gb")])
    share = lease("m", 8000, mode="mps")
    out = node.submit(share, 0.0, 0.0)
    complete(node, out.work)
    assert share.mode == "mps" and share.profile == "3g.20gb"
    (host,) = node.gpus[0].instances
    assert host.mps_pool is not None and host.mps_pool.max_clients == 48 * 3 // 7
    with pytest.raises(RequestTooLarge):
        node.submit(lease("huge", 30000, mode="mps"), 1.0, 1.0)


def test_the_last_share_leaves_the_host_idle_and_idle_teardown_destroys_it() -> None:
    gpu = mig_gpu(mps_in_mig=True)
    node = NodeScheduler([gpu], SchedulerPolicy(idle_policy="timeout", idle_timeout_s=10))
    a = lease("a", 1000)
    complete(node, node.submit(a, 0.0, 0.0).work)
    (host,) = gpu.instances
    assert node.idle_teardown(100.0, 100.0).work == []  # busy: it has a share
    node.release("a", 1.0, 1.0)
    assert host.mps_pool is not None and not host.mps_pool.shares and not host.busy
    # An idle MPS host is not given to a plain MIG request...
    plain = lease("p", 4000, mode="mig")
    out = node.submit(plain, 2.0, 2.0)
    assert plain.start != host.start and any(w.ops for w in out.work)
    # ... and goes after the idle timeout.
    (teardown,) = node.idle_teardown(20.0, 20.0).work
    assert [str(op) for op in teardown.ops] == [f"destroy {host}"] or any(
        isinstance(op, DestroyOp) and op.start == host.start for op in teardown.ops
    )


def test_a_failed_host_creation_sends_every_waiting_share_back_to_the_queue() -> None:
    gpu = mig_gpu(mps_in_mig=True)
    node = NodeScheduler([gpu])
    a, b = lease("a", 1000), lease("b", 1000)
    (work,) = node.submit(a, 0.0, 0.0).work
    node.submit(b, 0.1, 0.1)
    node.work_failed(work, InsufficientResources("injected"), 1.0)
    assert a.state is LeaseState.QUEUED and b.state is LeaseState.QUEUED
    assert gpu.instances == []


def test_per_user_hosts_another_user_gets_another_instance() -> None:
    gpu = mig_gpu(mps_in_mig=True)
    node = NodeScheduler([gpu])
    a = lease("a", 1000, uid=1000)
    complete(node, node.submit(a, 0.0, 0.0).work)
    b = lease("b", 1000, uid=2000)
    complete(node, node.submit(b, 1.0, 1.0).work, 1.0)
    assert a.mig_uuid != b.mig_uuid
    assert sorted(i.mps_pool.owner_uid for i in gpu.instances if i.mps_pool) == [1000, 2000]  # type: ignore[misc]


def test_restart_restores_a_share_onto_its_host_instance() -> None:
    gpu = mig_gpu(mps_in_mig=True)
    node = NodeScheduler([gpu])
    a = lease("a", 1000, mps_clients=2)
    complete(node, node.submit(a, 0.0, 0.0).work)
    (host,) = gpu.instances
    fresh_gpu = mig_gpu(mps_in_mig=True)
    fresh = NodeScheduler([fresh_gpu])
    fresh.resync(
        0,
        [(host.profile, host.start, host.gi_id, host.uuid, host.memory_mib)],
        {host.uuid or ""},
        5.0,
        read_at=fresh.books_version(0),
    )
    (found,) = fresh_gpu.instances
    assert found.origin is Origin.UNEXPLAINED  # processes without a lease, until restored
    fresh.leases[a.lease_id] = a
    assert fresh.restore_mps_share(fresh_gpu, a)
    assert found.origin is Origin.MIGD and found.busy
    assert found.mps_pool is not None and found.mps_pool.clients == 2
    gone = Lease("g", a.request, 1000, 1, 0.0, mode="mps", gpu=0, start=6, mig_uuid="MIG-x")
    assert not fresh.restore_mps_share(fresh_gpu, gone)


@pytest.mark.parametrize(
    ("min_compute", "explicit", "slices", "expected"),
    [(0, None, 7, None), (2, None, 7, 29), (1, None, 3, 34), (3, None, None, 43), (2, 10, 7, 10)],
)
def test_thread_percentage_is_explicit_or_min_compute_of_the_device(
    min_compute: int, explicit: int | None, slices: int | None, expected: int | None
) -> None:
    request = LeaseRequest("j", 1000, min_compute=min_compute, mps_thread_percentage=explicit)
    assert NodeScheduler.mps_thread_percentage(request, slices) == expected


def test_mps_fields_reach_the_share_the_env_and_the_accounting() -> None:
    gpu = ManagedGpu(0, "GPU-v100", "V100-32GB", "V100", 32768, MpsState())
    node = NodeScheduler([gpu], SchedulerPolicy(mps_reserve_mib=768))
    job = lease("j", 4096, mps_clients=3, min_compute=2)
    node.submit(job, 0.0, 0.0)
    assert gpu.mps_pool is not None
    (share,) = gpu.mps_pool.shares
    assert (share.clients, share.thread_percentage) == (3, 29)
    assert gpu.mps_pool.used_mib == 3 * 4096
    assert job.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "29"
    assert job.to_dict()["mps_clients"] == 3
    # memory x clients beyond the GPU can never fit
    with pytest.raises(RequestTooLarge):
        node.submit(lease("k", 16001, mps_clients=2), 1.0, 1.0)
    with pytest.raises(InvalidRequest):
        LeaseRequest("j", 1, mps_clients=0)
    with pytest.raises(InvalidRequest):
        LeaseRequest("j", 1, mps_thread_percentage=101)


# -- invariants under random sequences --------------------------------------------------------


def check(node: NodeScheduler, destroyed_busy: list[str]) -> None:
    assert not destroyed_busy, destroyed_busy
    for lease_ in node.leases.values():
        if lease_.mode != "mps" or not lease_.state.holds_resources:
            continue
        gpu = node.gpus[lease_.gpu or 0]
        hosts = [i for i in gpu.instances if i.mps_pool and i.mps_pool.share(lease_.lease_id)]
        assert len(hosts) == 1, lease_.lease_id  # exactly one share
        (host,) = hosts
        assert host.lease_id is None and host.start == lease_.start
        if lease_.state is LeaseState.ACTIVE:
            assert host.status is InstanceStatus.READY
            assert lease_.env["CUDA_VISIBLE_DEVICES"] == host.uuid == lease_.mig_uuid
    for gpu in node.gpus.values():
        for inst in gpu.instances:
            pool = inst.mps_pool
            if pool is None:
                continue
            assert pool.used_mib <= pool.capacity_mib and pool.clients <= pool.max_clients
            assert len({s.uid for s in pool.shares}) <= 1  # per-user
            for s in pool.shares:
                assert node.leases[s.share_id].state.holds_resources


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    idle=st.sampled_from(["keep", "destroy", "timeout"]),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["submit", "release", "complete", "fail", "idle"]),
            st.sampled_from([500, 1500, 3000, 4000, 9000, 20000]),
            st.sampled_from(["auto", "mps", "mig"]),
            st.integers(0, 10**6),
        ),
        min_size=1,
        max_size=50,
    ),
)
def test_mps_in_mig_invariants(idle: str, steps: list[tuple[str, int, str, int]]) -> None:
    gpu = mig_gpu(mps_in_mig=True)
    node = NodeScheduler(
        [gpu, mig_gpu(1, "H100-80GB", mps_in_mig=True, mps_profile="2g.20gb")],
        SchedulerPolicy(idle_policy=idle, idle_timeout_s=5, mps_reserve_mib=256),  # type: ignore[arg-type]
    )
    pending: list[Work] = []
    ids = itertools.count()
    now = 0.0
    destroyed_busy: list[str] = []

    def take(work: list[Work]) -> None:
        for w in work:
            for op in w.ops:
                if isinstance(op, DestroyOp):
                    inst = node.gpus[w.gpu].instance_at(op.start)
                    assert inst is not None
                    if inst.lease_id is not None or (inst.mps_pool and inst.mps_pool.shares):
                        destroyed_busy.append(str(inst))
            if w.ops:
                pending.append(w)

    for action, size, mode, pick in steps:
        now += 1.0
        if action == "submit":
            job = lease(f"L{next(ids)}", size, uid=1000 + pick % 2, mode=mode)
            with contextlib.suppress(RequestTooLarge, InvalidRequest):
                take(node.submit(job, now, now).work)
        elif action == "release":
            live = [x for x in node.leases.values() if not x.state.terminal]
            if live:
                take(node.release(live[pick % len(live)].lease_id, now, now).work)
        elif action in ("complete", "fail") and pending:
            work = pending.pop(0)
            if action == "complete":
                complete(node, [work], now, take)
            else:
                node.work_failed(work, InsufficientResources("injected"), now)
                g = node.gpus[work.gpu]
                observed = [
                    (i.profile, i.start, i.gi_id, i.uuid, i.memory_mib)
                    for i in g.instances
                    if i.status is InstanceStatus.READY
                ]
                node.resync(work.gpu, observed, set(), now, read_at=node.books_version(work.gpu))
            take(node.schedule(now, now).work)
        elif action == "idle":
            take(node.idle_teardown(now, now).work)
        check(node, destroyed_busy)
