"""The scheduler's use of the planner, the demand model and the queue (no I/O)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from migd.core import catalog
from migd.core import mig_mode as mig_mode_module
from migd.core.gpus import ExclusiveState, GpuMode, ManagedGpu, ManagedInstance, mode_state
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.core.planner import PlacementRule
from migd.core.policy import SchedulerPolicy
from migd.core.queueing import QueuePolicy
from migd.core.scheduler import NodeScheduler
from migd.core.states import state_space
from migd.errors import NoCapacity, RequestTooLarge, UnknownProfile

_ids = itertools.count()


def gpu(index: int, model: str, mode: GpuMode = GpuMode.MIG) -> ManagedGpu:
    geo = catalog.geometry(model)
    space = state_space(geo) if mode is GpuMode.MIG else None
    return ManagedGpu(
        index, f"GPU-{index:04d}", model, model, geo.memory_mib, mode_state(mode, space)
    )


def busy(g: ManagedGpu, name: str, start: int) -> None:
    """A running job's instance (held by a lease nobody will release in the test)."""
    assert g.mig is not None and g.mig.space is not None
    profile = g.mig.space.member(name)
    g.mig.instances.append(ManagedInstance(profile, start, profile.memory_mib, lease_id="other"))


def lease(memory_mib: int, wait_s: float | None = 60.0, **kw: Any) -> Lease:
    request = LeaseRequest(f"job{next(_ids)}", memory_mib, wait_s=wait_s, **kw)
    return Lease(f"L{next(_ids)}", request, 1000, 1, 0.0)


# -- demand ---------------------------------------------------------------------------------------


def test_demand_counts_requests_not_grants() -> None:
    """Queued and refused-for-now requests count, as the profile they right-size to."""
    node = NodeScheduler([gpu(0, "A100-40GB")])
    busy(node.gpus[0], "7g.40gb", 0)
    queued = node.submit(lease(9000), 1.0, 1.0)
    assert queued.lease.state is LeaseState.QUEUED
    assert isinstance(node.submit(lease(19000, wait_s=0.0), 1.0, 2.0).refusal, NoCapacity)
    space = node.gpus[0].space
    assert space is not None
    ids = {name: space.member(name).profile_id for name in ("1g.10gb", "3g.20gb")}
    assert node.demand.weights(1.0) == {
        "A100-40GB": {ids["1g.10gb"]: pytest.approx(0.5), ids["3g.20gb"]: pytest.approx(0.5)}
    }


def test_demand_records_the_right_size_not_the_upsized_grant() -> None:
    node = NodeScheduler([gpu(0, "A100-40GB")])
    busy(node.gpus[0], "3g.20gb", 4)
    out = node.submit(lease(19000), 1.0, 1.0)
    assert out.lease.profile == "4g.20gb"  # created bigger: the 4th compute slice is free
    space = node.gpus[0].space
    assert space is not None
    assert node.demand.weights(1.0) == {"A100-40GB": {space.member("3g.20gb").profile_id: 1.0}}


def test_demand_on_a_mixed_node_is_per_model() -> None:
    node = NodeScheduler([gpu(0, "A100-40GB"), gpu(1, "A30-24GB")])
    node.submit(lease(5000), 1.0, 1.0)
    a100, a30 = node.gpus[0].space, node.gpus[1].space
    assert a100 is not None and a30 is not None
    assert node.demand.weights(1.0) == {
        "A100-40GB": {a100.member("1g.10gb").profile_id: 1.0},
        "A30-24GB": {a30.member("1g.6gb").profile_id: 1.0},
    }


def test_weighted_placement_uses_the_models_own_mix() -> None:
    """Twenty 3g.20gb requests on the A100 steer a 2g.10gb to start 0 (plain
    reachability puts it at 4); the A30's demand is another model's business."""
    policy = SchedulerPolicy(demand_weighting=True)
    node = NodeScheduler([gpu(0, "A100-40GB"), gpu(1, "A30-24GB")], policy)
    a100 = node.gpus[0].space
    assert a100 is not None
    for _ in range(20):
        node.demand.observe("A100-40GB", a100.member("3g.20gb").profile_id, 0.0)
    node.set_draining(1, True, 0.0, 0.0)
    out = node.submit(lease(9000, min_compute=2), 1.0, 1.0)
    assert (out.lease.gpu, out.lease.profile, out.lease.start) == (0, "2g.10gb", 0)
    assert out.lease.decision is not None
    assert out.lease.decision["rule"] == PlacementRule.WEIGHTED.value
    plain = NodeScheduler([gpu(0, "A100-40GB")]).submit(lease(9000, min_compute=2), 1.0, 1.0)
    assert plain.lease.start == 4


# -- sizing errors --------------------------------------------------------------------------------


def test_too_much_compute_says_so() -> None:
    node = NodeScheduler([gpu(0, "A100-40GB")])
    with pytest.raises(RequestTooLarge) as err:
        node.submit(lease(1000, min_compute=8), 1.0, 1.0)
    assert "8 compute slices" in err.value.message and "the most is 7" in err.value.message
    assert "1000 MiB is more" not in err.value.message


def test_named_profile_on_a_mixed_node() -> None:
    node = NodeScheduler([gpu(0, "H100-80GB"), gpu(1, "A100-40GB")])
    out = node.submit(lease(4000, profile="1g.5gb"), 1.0, 1.0)
    assert (out.lease.gpu, out.lease.profile) == (1, "1g.5gb")
    with pytest.raises(UnknownProfile) as err:
        node.submit(lease(4000, profile="1g.6gb"), 1.0, 1.0)
    assert "H100-80GB:" in err.value.hint and "A100-40GB:" in err.value.hint


# -- the failure cache of a scheduling pass -------------------------------------------------------


def test_a_deep_queue_plans_once_per_partition_size(monkeypatch: pytest.MonkeyPatch) -> None:
    node = NodeScheduler([gpu(0, "A100-40GB"), gpu(1, "A100-40GB")], SchedulerPolicy())
    for g in node.gpus.values():
        busy(g, "7g.40gb", 0)
    for n in range(40):  # 40 different MiB figures, all 1g.10gb or 3g.20gb
        node.submit(lease(5000 + 97 * n if n % 2 else 10000 + 211 * n), 1.0, 1.0)
    calls = []
    real = mig_mode_module.plan_on_node

    def counting(*args: Any, **kw: Any) -> Any:
        calls.append(args[1])
        return real(*args, **kw)

    monkeypatch.setattr(mig_mode_module, "plan_on_node", counting)
    assert node.schedule(2.0, 2.0).work == []
    assert len(calls) == 1  # fifo: the head blocks the pass
    node.set_policy(SchedulerPolicy(queue=QueuePolicy.SIZE))
    calls.clear()
    assert node.schedule(3.0, 3.0).work == []
    sizes = {(c.memory_mib, c.min_compute) for c in calls}
    assert len(calls) == 2 == len(sizes), sizes  # one per distinct partition size


def test_the_failure_cache_does_not_hide_a_free_whole_gpu() -> None:
    """Two requests that right-size alike on the MIG GPU (7g.40gb) but only one of which
    fits the exclusive GPU: the first failing must not skip the second."""
    exclusive = gpu(1, "A30-24GB", GpuMode.EXCLUSIVE)
    node = NodeScheduler([gpu(0, "A100-40GB"), exclusive], SchedulerPolicy(queue=QueuePolicy.SIZE))
    busy(node.gpus[0], "7g.40gb", 0)
    exclusive.state = ExclusiveState(lease_id="someone")
    first = node.submit(lease(30000), 1.0, 1.0)
    second = node.submit(lease(23000), 1.0, 1.0)
    assert first.lease.state is second.lease.state is LeaseState.QUEUED
    exclusive.state = ExclusiveState()
    node.schedule(2.0, 2.0)
    assert second.lease.state is LeaseState.ACTIVE and second.lease.mode == "exclusive"
    assert first.lease.state is LeaseState.QUEUED


def test_too_large_for_every_mode_names_each_reason() -> None:
    node = NodeScheduler([gpu(0, "A100-40GB"), gpu(1, "A30-24GB", GpuMode.EXCLUSIVE)])
    with pytest.raises(RequestTooLarge) as err:
        node.submit(lease(50_000), 1.0, 1.0)
    assert "largest A100-40GB profile (7g.40gb, 40448 MiB)" in err.value.message
    assert "GPU 1's 24003 MiB" in err.value.message
    assert err.value.details["largest_mib"] == 40448


def test_a_refusal_hands_over_the_work_its_pass_started_for_others() -> None:
    """submit() refusing a wait_s=0 request must not lose what the same scheduling pass
    committed for requests queued before it (their instance is already in the books)."""
    node = NodeScheduler([gpu(0, "A100-40GB")])  # FIFO, no backfill
    busy(node.gpus[0], "4g.20gb", 0)
    node.gpus[0].health.raise_("test", "judged later", 0.0)  # outside the books: no pass
    behind = node.submit(lease(1500, wait_s=None), 1.0, 1.0).lease
    assert behind.state is LeaseState.QUEUED
    node.gpus[0].health.clear("test")
    refused = node.submit(big := lease(39000, wait_s=0.0), 201.0, 201.0)
    assert isinstance(refused.refusal, NoCapacity)
    assert behind.state is LeaseState.PREPARING
    [work] = refused.work
    assert work.lease_id == behind.lease_id and work.ops
    assert [(t.lease, t.new) for t in refused.transitions] == [(behind, LeaseState.PREPARING)]
    assert big.lease_id not in node.leases  # a refused lease is not kept


def test_an_expiry_places_what_the_expired_request_blocked() -> None:
    """The outcome of expire() has the follow-on work: callers never re-run the queue."""
    node = NodeScheduler([gpu(0, "A100-40GB")])  # FIFO, no backfill
    busy(node.gpus[0], "4g.20gb", 0)
    head = node.submit(lease(30000, wait_s=100.0), 0.0, 0.0).lease  # blocks the queue
    behind = node.submit(lease(1500, wait_s=None), 1.0, 1.0).lease
    assert head.state is behind.state is LeaseState.QUEUED
    expired = node.expire(200.0, 200.0)
    assert expired.ended == [head] and head.state is LeaseState.EXPIRED
    assert behind.state is LeaseState.PREPARING
    [work] = expired.work
    assert work.lease_id == behind.lease_id and work.ops


def test_a_refusal_explains_itself_on_a_layout_the_state_machine_cannot_describe() -> None:
    """A GPU whose instances form no valid state (health says why) must not turn a
    wait_s=0 refusal into an internal error."""
    node = NodeScheduler([gpu(0, "A100-40GB")])
    busy(node.gpus[0], "4g.20gb", 0)
    busy(node.gpus[0], "3g.20gb", 0)  # overlaps: no state of the model has both
    node.gpus[0].health.raise_("resync", "layout not understood", 0.0)
    refused = node.submit(lease(30000, wait_s=0.0), 1.0, 1.0).refusal
    assert refused is not None
    [why] = refused.details["considered"]
    assert why == {"gpu": 0, "state": "not understood", "why": "layout not understood"}
