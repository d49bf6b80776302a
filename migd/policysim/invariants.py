"""What must hold after every event of a simulation (``PolicySimConfig.check_invariants``).

Checked against the scheduler's own books, from what each run holds (its GPU's mode
driver says: :meth:`~migd.core.gpu_modes.GpuModeOps.holding`), so no check branches on
a GPU's mode: a MIG instance of its own, a share of an MPS server (in a MIG instance or
on the whole GPU), or the whole GPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from migd.core.gpus import InstanceStatus
from migd.policysim.nodes import PoolNode
from migd.policysim.runs import Run


def check_invariants(
    nodes: Sequence[PoolNode], gpu_runs: Mapping[tuple[int, int], Mapping[str, Run]], compute: int
) -> None:
    """Assert the invariants (used by the tests and ``--check``).

    Raises:
        AssertionError: a GPU holds more than it has, a layout is not a valid state,
            a running job has no instance, a whole GPU runs two jobs, or a node keeps an
            ended lease (the daemon drops them).
    """
    for node in nodes:
        ended = [k for k, v in node.scheduler.leases.items() if v.state.terminal]
        assert not ended, f"node {node.index} keeps ended leases {ended}"
        for gpu in node.scheduler.gpus.values():
            policy = node.scheduler.policy
            node.scheduler.mode_ops(gpu).slice_usage(gpu)  # its layout is a valid state
            runs = gpu_runs.get((node.index, gpu.index), {})
            used = taken = 0
            hosts: dict[int, list[Run]] = {}
            whole: list[Run] = []
            for lid, r in runs.items():
                if r.holding.profile is None:
                    whole.append(r)
                    continue
                inst = gpu.instance_at(r.unit_start)
                if r.holding.shared:  # a share of the MPS server inside an instance
                    assert inst is not None and inst.mps_pool is not None, f"{lid}: host"
                    assert inst.mps_pool.share(lid) is not None, f"{lid}: no share"
                    assert inst.status is InstanceStatus.READY, f"{lid}: host not ready"
                    hosts.setdefault(r.host, []).append(r)
                    continue
                assert inst is not None and inst.lease_id == lid, f"{lid}: no instance"
                assert inst.status is InstanceStatus.READY, f"{lid}: instance not ready"
                used += inst.profile.compute_slices
                mask = inst.profile.units_mask(inst.start)
                assert not taken & mask, f"{lid}: overlapping units"
                taken |= mask
            for start, members in hosts.items():
                inst = gpu.instance_at(start)
                assert inst is not None and inst.mps_pool is not None
                pinned = sum(r.attempt.memory_mib for r in members)
                assert pinned <= inst.mps_pool.capacity_mib, f"host {inst}: {pinned} MiB"
                assert len({r.uid for r in members}) == 1 or policy.mps_multi_user, (
                    f"host {inst}: clients of several users"
                )
                mask = inst.profile.units_mask(inst.start)
                assert not taken & mask, f"host {inst}: overlapping units"
                taken |= mask
                used += inst.profile.compute_slices
            assert used <= compute, f"GPU {gpu.index}: {used} compute slices busy"
            alone = [r for r in whole if not r.holding.shared]
            assert len(alone) <= 1, f"GPU {gpu.index}: {len(alone)} jobs on a whole GPU"
            shared = [r for r in whole if r.holding.shared]
            pinned = sum(r.attempt.memory_mib for r in shared)
            cap = gpu.memory_total_mib - policy.mps_reserve_mib
            assert pinned <= cap, f"GPU {gpu.index}: {pinned} MiB pinned of {cap}"
            assert sum(r.share for r in shared) <= 1.0 + 1e-9
