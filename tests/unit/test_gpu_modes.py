"""Per-mode GPU state (core/gpus.py) and the mode drivers (core/gpu_modes.py)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from migd.core import catalog
from migd.core.gpus import (
    ExclusiveState,
    GpuMode,
    ManagedGpu,
    MigState,
    MpsState,
    OffState,
    mode_state,
)
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.core.scheduler import NodeScheduler
from migd.core.states import state_space

_ids = itertools.count()
GEO = catalog.geometry("A100-40GB")


def gpu(mode: GpuMode, index: int = 0, **kw: Any) -> ManagedGpu:
    space = state_space(GEO) if mode is GpuMode.MIG else None
    state = mode_state(mode, space, **kw)
    return ManagedGpu(index, f"GPU-{index:04d}", GEO.model, GEO.model, GEO.memory_mib, state)


def lease(memory_mib: int, **kw: Any) -> Lease:
    request = LeaseRequest(f"job{next(_ids)}", memory_mib, **kw)
    return Lease(f"L{next(_ids)}", request, 1000, 1, 0.0)


def test_each_gpu_holds_only_its_modes_state() -> None:
    mig, mps, whole, off = (gpu(m) for m in GpuMode.__members__.values())
    assert [g.mode for g in (mig, mps, whole, off)] == list(GpuMode)
    assert isinstance(mig.state, MigState) and mig.mig is mig.state
    assert isinstance(mps.state, MpsState) and mps.mps is mps.state
    assert isinstance(whole.state, ExclusiveState) and whole.exclusive is whole.state
    assert isinstance(off.state, OffState)
    # Another mode's fields read as empty, never as stale values of a former mode.
    for g in (mps, whole, off):
        assert g.mig is None and g.space is None and g.instances == () and not g.mps_in_mig
        assert g.instance_at(0) is None and g.instance_of("L") is None
    for g in (mig, whole, off):
        assert g.mps is None and g.mps_pool is None
    for g in (mig, mps, off):
        assert g.exclusive is None and g.exclusive_lease is None


def test_a_state_space_or_mps_inside_mig_is_for_mig_gpus_only() -> None:
    assert mode_state(GpuMode.MIG, mps_in_mig=True) == MigState(mps_in_mig=True)
    for mode in (GpuMode.MPS, GpuMode.EXCLUSIVE, GpuMode.OFF):
        with pytest.raises(ValueError, match="MIG GPUs"):
            mode_state(mode, state_space(GEO))
        with pytest.raises(ValueError, match="MIG GPUs"):
            mode_state(mode, mps_in_mig=True)


def test_the_scheduler_asks_each_gpu_the_driver_of_its_mode() -> None:
    gpus = [gpu(mode, index) for index, mode in enumerate(GpuMode)]
    node = NodeScheduler(gpus)
    assert [node.mode_ops(g).mode for g in gpus] == list(GpuMode)


@pytest.mark.parametrize(
    ("mode", "kw", "served"),
    [
        (GpuMode.MIG, {}, {"mig", "auto"}),
        (GpuMode.MIG, {"mps_in_mig": True}, {"mig", "mps", "auto"}),
        (GpuMode.MPS, {}, {"mps", "auto"}),
        (GpuMode.EXCLUSIVE, {}, {"auto"}),
        (GpuMode.OFF, {}, set()),
    ],
)
def test_which_request_modes_a_gpu_mode_serves(
    mode: GpuMode, kw: dict[str, Any], served: set[str]
) -> None:
    """A request's mode (what the job asks for) is not a GPU's mode (what it runs)."""
    g = gpu(mode, **kw)
    ops = NodeScheduler([g]).mode_ops(g)
    assert {m for m in ("mig", "mps", "auto") if ops.serves(g, m)} == served  # type: ignore[arg-type]


def test_what_status_shows_per_mode() -> None:
    full = max(p.memory_mib for p in state_space(GEO).profiles)
    whole, mps, mig = gpu(GpuMode.EXCLUSIVE, 0), gpu(GpuMode.MPS, 1), gpu(GpuMode.MIG, 2)
    node = NodeScheduler([whole, mps, mig])
    reserve = node.policy.mps_reserve_mib
    ops = {g.mode: node.mode_ops(g) for g in (whole, mps, mig)}
    assert ops[GpuMode.EXCLUSIVE].largest_placeable(whole) == ("whole-gpu", GEO.memory_mib)
    assert ops[GpuMode.MPS].largest_placeable(mps) == ("mps", GEO.memory_mib - reserve)
    assert ops[GpuMode.MIG].largest_placeable(mig) == ("7g.40gb", full)
    assert [ops[g.mode].placeable_mib(g) for g in (whole, mps, mig)] == [
        GEO.memory_mib,
        GEO.memory_mib - reserve,
        full,
    ]
    assert all(ops[g.mode].allocated_mib(g) == 0 for g in (whole, mps, mig))
    for gpu_uuid in ("GPU-0000", "GPU-0001"):
        granted = node.submit(lease(4000, gpu_uuids=(gpu_uuid,)), 1.0, 1.0).lease
        assert granted is not None and granted.state is LeaseState.ACTIVE
    assert whole.exclusive_lease is not None
    assert ops[GpuMode.EXCLUSIVE].largest_placeable(whole) is None
    assert ops[GpuMode.EXCLUSIVE].placeable_mib(whole) == 0
    assert ops[GpuMode.EXCLUSIVE].allocated_mib(whole) == GEO.memory_mib
    assert ops[GpuMode.MPS].allocated_mib(mps) == 4000
    assert ops[GpuMode.MPS].placeable_mib(mps) == GEO.memory_mib - reserve - 4000


@pytest.mark.parametrize(
    ("granted", "now", "reason"),
    [
        (GpuMode.EXCLUSIVE, GpuMode.MPS, "its GPU runs in mps mode now"),
        (GpuMode.MPS, GpuMode.EXCLUSIVE, "its GPU runs in exclusive mode now"),
        (GpuMode.EXCLUSIVE, GpuMode.MIG, "its GPU runs in mig mode now"),
        (GpuMode.MIG, GpuMode.MPS, "its MIG instance is gone"),
        (GpuMode.EXCLUSIVE, GpuMode.OFF, "its GPU runs in off mode now"),
    ],
)
def test_a_lease_restored_onto_a_gpu_in_another_mode_is_reclaimed(
    granted: GpuMode, now: GpuMode, reason: str
) -> None:
    """The config changed the GPU's mode across a restart: what the lease held is gone,
    and no other mode's books take it (an MPS GPU never books an exclusive holder)."""
    g = gpu(now)
    node = NodeScheduler([g])
    old = lease(4000)
    old.state, old.gpu, old.gpu_uuid, old.mode = LeaseState.ACTIVE, 0, g.uuid, granted
    old.start, old.profile = (0, "7g.40gb") if granted is GpuMode.MIG else (None, None)
    outcome = node.restore(old, 1.0)
    assert [(t.old, t.new) for t in outcome.transitions] == [
        (LeaseState.ACTIVE, LeaseState.RECLAIMED)
    ]
    assert old.reason == reason
    assert g.exclusive_lease is None and g.mps_pool is None and not g.instances


@pytest.mark.parametrize("mode", [GpuMode.EXCLUSIVE, GpuMode.MPS])
def test_a_lease_restored_onto_its_own_mode_is_bound_again(mode: GpuMode) -> None:
    g = gpu(mode)
    node = NodeScheduler([g])
    old = lease(4000)
    old.state, old.gpu, old.gpu_uuid, old.mode = LeaseState.ACTIVE, 0, g.uuid, mode
    old.memory_limit_mib = 4000
    assert node.restore(old, 1.0).transitions == []
    assert old.state is LeaseState.ACTIVE
    if mode is GpuMode.EXCLUSIVE:
        assert g.exclusive_lease == old.lease_id
    else:
        assert g.mps_pool is not None
        assert [(s.share_id, s.memory_mib) for s in g.mps_pool.shares] == [(old.lease_id, 4000)]


def test_a_mig_gpu_without_a_state_machine_gives_a_reason_not_an_empty_one() -> None:
    """A MIG GPU whose state machine could not be built (no MIG geometry, profiles its
    model lacks) refused every request with "...can ever hold the request: " and nothing
    after it, which migd-run printed as it was (issue 24 s4)."""
    from migd.core.planner import PartitionRequest, never_fits_error
    from migd.errors import RequestTooLarge

    g = ManagedGpu(0, "GPU-0000", GEO.model, GEO.model, GEO.memory_mib, mode_state(GpuMode.MIG))
    g.health.raise_("startup", "no MIG geometry: unknown profile '9g.99gb'", 0.0)
    node = NodeScheduler([g])
    with pytest.raises(RequestTooLarge) as refused:
        node.submit(lease(4000, mode="mig"), 1.0, 1.0)
    assert refused.value.message.endswith(
        "GPU 0 (A100-40GB) cannot hold MIG instances: no MIG geometry: unknown profile '9g.99gb'"
    )
    # Whatever the GPUs said, the error names a reason.
    error = never_fits_error(PartitionRequest(4000), [], ["", ""])
    assert not error.message.rstrip().endswith(":") and "4000 MiB" in error.message
