"""Which GPUs HTCondor's startd must stop assigning, and when migd tells it (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from migd.core.condor_shares import (
    OfflineShares,
    offline_share_ids,
    out_of_service,
    physical_gpu,
    share_id,
    short_uuid,
)
from migd.core.gpus import ExclusiveState, GpuMode, ManagedGpu, MpsState, OffState, mode_state

UUIDS = [f"GPU-{n}1234567-89ab-cdef-0123-456789abcdef" for n in range(4)]


def gpu(index: int, state: object = None) -> ManagedGpu:
    return ManagedGpu(
        index, UUIDS[index], "A100-40GB", "A100", 40960, state or mode_state(GpuMode.MIG)
    )


def test_share_ids_are_the_inventory_ids_of_each_gpu() -> None:
    assert short_uuid(UUIDS[0]) == "GPU-01234567"
    assert share_id(UUIDS[0], 3) == "GPU-s03-01234567"
    assert offline_share_ids(UUIDS[:2], 2) == [
        "GPU-s00-01234567",
        "GPU-s01-01234567",
        "GPU-s00-11234567",
        "GPU-s01-11234567",
    ]
    assert offline_share_ids([], 7) == []
    # the wrapper's reading of AssignedGPUs undoes the naming
    for uuid in UUIDS:
        assert {physical_gpu(share_id(uuid, n)) for n in range(48)} == {short_uuid(uuid)}


def test_a_gpu_is_out_of_service_for_htcondor_when_migd_gives_it_no_new_lease() -> None:
    healthy, drained, failed, off = gpu(0), gpu(1), gpu(2), gpu(3, OffState())
    drained.draining = True
    failed.health.raise_("xid", "XID 79 (GPU has fallen off the bus) on GPU 2", 0.0)
    off.health.raise_("startup", "not managed", 0.0)
    assert out_of_service([healthy, drained, failed, off]) == (UUIDS[1], UUIDS[2])
    # every mode migd manages counts, not only MIG
    for state in (MpsState(), ExclusiveState()):
        other = gpu(0, state)
        other.health.raise_("mps", "MPS daemon cannot be restarted", 0.0)
        assert out_of_service([other]) == (UUIDS[0],)


def test_the_first_step_writes_then_only_changes_are_written() -> None:
    gpus = [gpu(0), gpu(1)]
    sync = OfflineShares()
    assert sync.step(gpus, 0.0) == ()  # corrects a file an earlier migd left
    sync.applied(())
    assert sync.step(gpus, 1.0) is None
    gpus[1].health.raise_("xid", "XID 79", 1.0)
    assert sync.step(gpus, 2.0) == (UUIDS[1],)
    sync.applied((UUIDS[1],))
    assert sync.written == (UUIDS[1],)
    assert sync.step(gpus, 3.0) is None
    gpus[1].health.clear("xid")
    assert sync.step(gpus, 4.0) == ()


def test_a_failed_write_is_retried_after_a_pause_and_a_change_at_once() -> None:
    gpus = [gpu(0), gpu(1)]
    sync = OfflineShares(retry_s=30.0)
    sync.applied(())
    gpus[0].draining = True
    assert sync.step(gpus, 10.0) == (UUIDS[0],)
    sync.failed((UUIDS[0],), 10.0)
    assert sync.step(gpus, 39.9) is None  # not every round while HTCondor is down
    assert sync.step(gpus, 40.0) == (UUIDS[0],)
    sync.failed((UUIDS[0],), 40.0)
    gpus[1].draining = True  # a new verdict does not wait for the retry
    assert sync.step(gpus, 41.0) == (UUIDS[0], UUIDS[1])


@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=4))
def test_after_a_write_the_startd_is_told_exactly_the_out_of_service_gpus(
    verdicts: list[tuple[bool, bool]],
) -> None:
    gpus = [gpu(n) for n in range(len(verdicts))]
    sync = OfflineShares()
    sync.applied(())
    for g, (draining, failed) in zip(gpus, verdicts, strict=True):
        g.draining = draining
        if failed:
            g.health.raise_("xid", "XID 79", 0.0)
    wanted = sync.step(gpus, 0.0)
    expected = tuple(sorted(u for u, (d, f) in zip(UUIDS, verdicts, strict=False) if d or f))
    assert wanted == (None if expected == () else expected)
    if wanted is not None:
        sync.applied(wanted)
    assert sync.step(gpus, 1.0) is None
