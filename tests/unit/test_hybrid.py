"""The hybrid policy (migd.core.hybrid) alone, and through the scheduler's hook."""

from __future__ import annotations

import pytest

from migd.core import catalog
from migd.core.gpus import InstanceStatus, ManagedGpu, MigState, Work
from migd.core.hybrid import HybridPolicy, ShareRule
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.core.planner import CreateOp, DestroyOp
from migd.core.policy import SchedulerPolicy
from migd.core.scheduler import NodeScheduler
from migd.core.states import state_space
from migd.errors import InvalidRequest

GEO = catalog.geometry("A100-40GB")
PROFILES = state_space(GEO).profiles


def test_small_jobs_share_because_they_pack_denser() -> None:
    route = HybridPolicy().route(PROFILES, 3000)
    assert route.share
    assert "7g.40gb" in route.reason and "1g.5gb" in route.reason


def test_a_job_that_fills_its_smallest_instance_keeps_it() -> None:
    # 8 of 4800 MiB in a 7g host is 1 per memory slice: no gain over 1g.5gb, MIG isolates
    route = HybridPolicy().route(PROFILES, 4800)
    assert not route.share
    assert "no better" in route.reason


def test_mode_and_named_profile_decide_first() -> None:
    hybrid = HybridPolicy()
    assert not hybrid.route(PROFILES, 1000, mode="mig").share
    assert not hybrid.route(PROFILES, 1000, named_profile=True).share
    assert hybrid.route(PROFILES, 4800, mode="mps").share  # opted in


@pytest.mark.parametrize(
    ("rule", "memory", "mode", "shares"),
    [
        (ShareRule.OPT_IN, 3000, "auto", False),
        (ShareRule.OPT_IN, 3000, "mps", True),
        (ShareRule.SIZE, 4800, "mps", False),  # size only: an opt-in must pack better too
        (ShareRule.SIZE, 3000, "auto", True),
    ],
)
def test_share_rules(rule: ShareRule, memory: int, mode: str, shares: bool) -> None:
    assert HybridPolicy(rule=rule).route(PROFILES, memory, mode=mode).share is shares


def test_share_max_caps_the_size_rule() -> None:
    route = HybridPolicy(share_max_mib=2000).route(PROFILES, 3000)
    assert not route.share and "share_max_mib" in route.reason
    with pytest.raises(InvalidRequest):
        HybridPolicy(share_max_mib=0)


def test_host_size_follows_demand_and_skips_hosts_that_pack_no_better() -> None:
    hybrid = HybridPolicy()
    order, why = hybrid.host_profiles(PROFILES, 3000, demand_mib=3000)
    # 1g.5gb holds one 3 GB job and 2g.10gb two: no denser than own 1g instances
    assert order[0].name in ("3g.20gb", "4g.20gb")
    assert all(p.name not in ("1g.5gb", "2g.10gb") for p in order)
    big, why = hybrid.host_profiles(PROFILES, 3000, demand_mib=30000)
    assert big[0].name == "7g.40gb" and "30000 MiB" in why
    # then smaller hosts that still hold it, largest first
    rest = [p.memory_mib for p in big[1:]]
    assert rest == sorted(rest, reverse=True)


def _gpu() -> ManagedGpu:
    return ManagedGpu(
        0,
        "GPU-0000",
        GEO.model,
        GEO.model,
        GEO.memory_mib,
        MigState(state_space(GEO), mps_in_mig=True),
        compute_slices=GEO.compute_slices,
    )


def _lease(lease_id: str, memory: int, uid: int = 1000) -> Lease:
    return Lease(lease_id, LeaseRequest(lease_id, memory, wait_s=60.0), uid, 1, 0.0)


def _finish(node: NodeScheduler, work: list[Work]) -> None:
    for w in work:
        created = {
            op.start: (op.start + 1, f"MIG-{op.start}", op.profile.memory_mib)
            for op in w.ops
            if isinstance(op, CreateOp)
        }
        node.work_done(w, created, 1.0, 1.0)


def test_scheduler_routes_through_the_hook_and_explains() -> None:
    node = NodeScheduler([_gpu()], SchedulerPolicy(hybrid=HybridPolicy()))
    small = node.submit(_lease("a", 3000), 0.0, 0.0)
    _finish(node, small.work)
    big = node.submit(_lease("b", 15000), 0.0, 0.0)
    _finish(node, big.work)
    a, b = node.leases["a"], node.leases["b"]
    assert a.state is LeaseState.ACTIVE and a.mode == "mps" and a.profile is not None
    assert a.decision is not None and a.decision["reason"].startswith("hybrid: 3000 MiB packs")
    assert "host" in a.decision["hybrid"]
    assert b.mode == "mig" and b.decision is not None and "packs no better" in b.decision["hybrid"]


def test_users_get_separate_hosts_and_an_emptied_host_is_destroyed() -> None:
    node = NodeScheduler([_gpu()], SchedulerPolicy(hybrid=HybridPolicy()))
    for lid, uid in (("a", 1000), ("b", 1000), ("c", 2000)):
        _finish(node, node.submit(_lease(lid, 3000, uid), 0.0, 0.0).work)
    la, lb, lc = (node.leases[x] for x in "abc")
    assert (la.start, la.profile) == (lb.start, lb.profile)  # same user: same server
    assert lc.start != la.start  # another user: another instance (MIG isolates them)
    gpu = node.gpus[0]
    host = gpu.instance_at(lc.start) if lc.start is not None else None
    assert host is not None and host.mps_pool is not None
    outcome = node.release("c", 2.0, 2.0)
    # never handed to a MIG lease with its server still up: destroyed (server stopped first)
    assert host.status is InstanceStatus.DESTROYING
    assert any(
        isinstance(op, DestroyOp) and op.start == host.start for w in outcome.work for op in w.ops
    )
    node.release("a", 3.0, 3.0)  # the shared host stays while b runs
    shared = gpu.instance_at(lb.start) if lb.start is not None else None
    assert shared is not None and shared.status is InstanceStatus.READY
