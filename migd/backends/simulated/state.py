"""The simulated node's state as plain data: GPUs, their instances, and processes.

:class:`~migd.backends.simulated.node.SimNode` holds these; its parts
(:mod:`~migd.backends.simulated.mig_ops`, :mod:`~migd.backends.simulated.processes`,
:mod:`~migd.backends.simulated.persist`) change and read them under the node lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from migd.backends.simulated.specs import SimGpuSpec
from migd.core.geometry import Geometry, Profile


@dataclass(eq=False)
class SimComputeInstance:
    serial: int  # unique for the node's lifetime (handles stay unique even when ids are reused)
    ci_id: int
    profile_index: int  # NVML_COMPUTE_INSTANCE_PROFILE_*
    slices: int
    uuid: str  # the MIG device UUID
    # Index of its MIG device under the parent (nvmlDeviceGetMigDeviceHandleByIndex): the
    # lowest free slot when the compute instance was made, so destroys leave holes.
    mig_index: int = 0
    # MIG device handle lookups that still answer NOT_FOUND for this new device
    # (SimNode.mig_handle_delay): the handle appears a moment after the creation returns.
    hidden_lookups: int = 0


@dataclass(eq=False)
class SimGpuInstance:
    serial: int
    gi_id: int
    profile: Profile
    start: int
    cis: dict[int, SimComputeInstance] = field(default_factory=dict)  # by ci_id

    @property
    def size(self) -> int:
        return self.profile.memory_slices

    @property
    def units(self) -> set[int]:
        return set(range(self.start, self.start + self.profile.memory_slices))


@dataclass(eq=False)
class SimProcess:
    pid: int
    gpu: int
    gi_serial: int | None  # None: the whole (non-MIG) GPU
    ci_serial: int | None
    device_uuid: str
    used_mib: int = 0
    mps: bool = False
    mps_pinned_limit_mib: int | None = None
    # Start time of the host process with this PID when it attached (None: no such host
    # process, a purely simulated one). Tells a reused PID apart on a reload.
    host_start_s: float | None = None
    # An MPS server (Processes.track_mps_servers): an NVML compute process on its device for
    # as long as its host process lives.
    mps_server: bool = False


@dataclass(eq=False)
class SimGpu:
    """Live state of one simulated GPU."""

    index: int
    spec: SimGpuSpec
    uuid: str
    pci_bus_id: str
    mig_current: bool | None
    mig_pending: bool | None
    lost: bool = False
    instances: dict[int, SimGpuInstance] = field(default_factory=dict)  # by gi_id

    @property
    def geometry(self) -> Geometry | None:
        return self.spec.geometry


@dataclass(frozen=True, slots=True)
class InstanceView:
    """A read-only snapshot of one GPU instance (for tests and ``migd --simulate`` status)."""

    gi_id: int
    profile_id: int
    profile_name: str
    start: int
    size: int
    ci_ids: tuple[int, ...]
    uuids: tuple[str, ...]


__all__ = ["InstanceView", "SimComputeInstance", "SimGpu", "SimGpuInstance", "SimProcess"]
