"""Scheduler books for the metrics tests, built and driven as the daemon does (no I/O)."""

from __future__ import annotations

import itertools
from typing import Any

from migd.core import catalog
from migd.core.gpus import GpuMode, ManagedGpu, Work, mode_state
from migd.core.leases import Lease, LeaseRequest
from migd.core.planner import CreateOp
from migd.core.scheduler import NodeScheduler
from migd.core.states import state_space

_ids = itertools.count()


def gpu(index: int, model: str = "A100-40GB", mode: GpuMode = GpuMode.MIG, **kw: Any) -> ManagedGpu:
    geo = catalog.geometry(model)
    space = state_space(geo) if mode is GpuMode.MIG else None
    return ManagedGpu(
        index,
        f"GPU-{index:04d}",
        model,
        model,
        geo.memory_mib,
        mode_state(mode, space, **kw),
        compute_slices=geo.compute_slices,
    )


def lease(memory_mib: int, wait_s: float | None = 60.0, created_s: float = 0.0, **kw: Any) -> Lease:
    request = LeaseRequest(f"{next(_ids)}.0", memory_mib, wait_s=wait_s, **kw)
    return Lease(f"L{next(_ids)}", request, 1000, 1, created_s)


def finish(node: NodeScheduler, work: list[Work], now: float) -> None:
    """Carry out the scheduler's NVML work as a backend would (GI id = start + 1)."""
    for item in work:
        created = {
            op.start: (op.start + 1, f"MIG-{item.gpu}-{op.start}", op.profile.memory_mib)
            for op in item.ops
            if isinstance(op, CreateOp)
        }
        node.work_done(item, created, now, now)
