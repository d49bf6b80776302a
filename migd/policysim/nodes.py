"""A simulated node: its real :class:`NodeScheduler` and what the simulator keeps beside it.

:func:`build_node` makes a node's GPUs in the policy's mode (and a static layout's
instances, pre-created); :class:`PoolNode` holds the node's scheduler, the attempts it
granted that have not started yet, and its advertisement as the matcher last saw it.
"""

from __future__ import annotations

from migd.core.geometry import Geometry
from migd.core.gpus import GpuMode, ManagedGpu, ManagedInstance, mode_state
from migd.core.scheduler import NodeScheduler
from migd.core.states import StateSpace
from migd.errors import InvalidRequest
from migd.policysim.driver import NvmlDriver
from migd.policysim.policies import PolicySpec
from migd.policysim.records import Attempt


class PoolNode:
    """One node of the simulated pool (or the only node)."""

    def __init__(self, index: int, scheduler: NodeScheduler) -> None:
        self.index = index
        self.scheduler = scheduler
        self.pending: dict[str, Attempt] = {}  # granted, waiting to become active
        self.capacity: int | None = None  # advertised MiB, cached until the node changes
        self.ad_due: float | None = None  # when its pending, freed-memory ad is seen
        self.rooms: dict[int | None, int] = {}  # its MPS hosts' unpinned MiB by user
        # whether a (memory_mib, min_compute) request could ever fit: the node's GPUs,
        # modes and policy never change in a simulation, so neither does the answer
        self.ever_fits: dict[tuple[int, int], bool] = {}


def build_node(
    index: int,
    gpus: int,
    *,
    geo: Geometry,
    space: StateSpace,
    policy: PolicySpec,
    driver: NvmlDriver,
) -> PoolNode:
    """Node ``index`` with ``gpus`` GPUs of ``geo`` in the policy's mode.

    Raises:
        InvalidRequest: a static layout for GPUs that are not in MIG mode.
    """
    made = []
    mode = policy.gpu_mode
    mig = mode is GpuMode.MIG  # the GPUs' books are built for their mode once, here
    for g in range(gpus):
        gpu = ManagedGpu(
            index=g,
            uuid=f"GPU-sim-{index:02d}-{g}",
            model=geo.model,
            name=geo.display_name,
            memory_total_mib=geo.memory_mib,
            state=mode_state(mode, space if mig else None, mps_in_mig=policy.mps_in_mig and mig),
        )
        if policy.static_layout is not None:
            state = gpu.mig
            if state is None:
                raise InvalidRequest("a static layout needs GpuMode.MIG")
            for name, start in policy.static_layout:
                prof = space.member(name)
                n = driver.new_instance(index, g, start, prof.name, prof.memory_slices, 0.0)
                state.instances.append(
                    ManagedInstance(
                        profile=prof,
                        start=start,
                        memory_mib=prof.memory_mib,
                        gi_id=n,
                        uuid=f"MIG-sim-{index}-{g}-{n}",
                        idle_since_s=0.0,
                    )
                )
            space.key_of((i.profile, i.start) for i in gpu.instances)  # validate
        made.append(gpu)
    return PoolNode(index, NodeScheduler(made, policy.scheduler))
