"""A simulated GPU node: what NVML and CUDA programs on it would see. Thread-safe.

:class:`SimNode` keeps the state of every GPU (MIG mode, GPU and compute
instances, processes and their memory) and enforces MIG placement rules the way
the driver does. :class:`~migd.backends.simulated.fake_pynvml.FakePynvml` exposes
it through the ``pynvml`` API; tests also drive it directly (workloads, faults).

Placement legality is implemented here from the geometry's *data* (legal starts,
placement sizes, per-profile instance limits, exclusive groups, engine budget),
with its own plain unit-set arithmetic, and deliberately without
:mod:`migd.core.states`: tests compare the two, so each checks the other.

Errors NVML would return are raised as :class:`~migd.backends.simulated.nvml_api.NVMLError`
with the code real NVML documents (``nvml.h`` of NVIDIA/go-nvml ``2f9e261``, cited
at each raise). Errors a CUDA program would see are :class:`SimCudaError`.

With a ``state_file`` the node outlives its process, as real GPUs outlive a
``kill -9`` of the daemon: every change is written to the file atomically
(:mod:`migd.backends.simulated.persist`) and a new node with the same file starts
where the old one stopped. On such a load, simulated processes whose host PID is
gone (or now belongs to another process) are dropped, as the driver drops a dead
process's context; see :meth:`SimNode.snapshot`.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import uuid as uuid_module
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from migd.backends.procs import PsutilProcessTable
from migd.backends.simulated import nvml_api as api
from migd.backends.simulated import persist
from migd.backends.simulated.specs import (
    SimGpuSpec,
    SimInstanceSpec,
    SimProcessSpec,
    parse_probe,
    parse_source,
    read_json,
)
from migd.core.costs import CostModel
from migd.core.geometry import Geometry, Profile
from migd.errors import ConfigError, MigdError, StateStoreError, UnknownProfile
from migd.ports import ProcessTable

_log = logging.getLogger(__name__)

MIB = 1024 * 1024
DEFAULT_DRIVER_VERSION = "580.95.05"
DEFAULT_CUDA_VERSION = 13000  # nvmlSystemGetCudaDriverVersion encoding: 1000*major + 10*minor

# NVML_COMPUTE_INSTANCE_PROFILE_* index -> compute slices (nvml.h). 0x7 is
# COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1: a second 1-slice entry, which NVIDIA's DRA driver
# skips because it has "the same number of slices" as 1_SLICE (k8s-dra-driver-gpu,
# cmd/gpu-kubelet-plugin/nvlib.go, inspectMigProfilesAndPlacements). The simulator reports
# it under the plain 1-slice profile's id (REV1_REPORTED_ID), the case in which a reader
# that does not de-duplicate lists every 1-slice CI twice (docs/nvml.md). 7_SLICE_NVL
# (0x8) is not offered.
CI_PROFILE_1_SLICE_REV1 = 0x7
CI_PROFILE_SLICES: dict[int, int] = {
    0x0: 1,
    0x1: 2,
    0x2: 3,
    0x3: 4,
    0x4: 7,
    0x5: 8,
    0x6: 6,
    CI_PROFILE_1_SLICE_REV1: 1,
}
#: The profile id ``nvmlGpuInstanceGetComputeInstanceProfileInfo`` reports for REV1.
REV1_REPORTED_ID = 0x0


#: Memory an MPS server holds on its device in the simulator (its own context). Unknown
#: on real GPUs until a probe records one (scripts/gpu_probe.py --mps).
MPS_SERVER_USED_MIB = 0

#: PIDs of processes left behind (SimNode.leave_behind) start above Linux's largest
#: pid_max (2^22), so they are never a host process.
LEFT_BEHIND_FIRST_PID = 1 << 22


class SimCudaError(RuntimeError):
    """An error a CUDA program on the simulated node would get (``CUDA error: ...``)."""


class SimOutOfMemory(SimCudaError):
    """``cudaErrorMemoryAllocation`` (2): the allocation does not fit.

    Raised past the MIG device's memory, past an MPS client's pinned-memory limit,
    or past a non-MIG GPU's memory, exactly where ``cudaMalloc`` would fail.
    """

    def __init__(
        self,
        *,
        pid: int,
        device_uuid: str,
        requested_mib: int,
        used_mib: int,
        limit_mib: int,
        limit: str,
    ) -> None:
        super().__init__(
            f"CUDA error: out of memory (pid {pid} tried to allocate {requested_mib} MiB on "
            f"{device_uuid}; {used_mib} MiB of the {limit} of {limit_mib} MiB already in use)"
        )
        self.pid = pid
        self.device_uuid = device_uuid
        self.requested_mib = requested_mib
        self.used_mib = used_mib
        self.limit_mib = limit_mib
        self.limit = limit


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
    # An MPS server (SimNode.track_mps_servers): an NVML compute process on its device for
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


@dataclass
class _Injected:
    call: str
    code: int
    times: int
    gpu: int | None


class SimNode:
    """A stateful simulated node. Every public method is thread-safe.

    Args:
        gpus: the GPUs, in NVML index order.
        seed: seeds GPU UUIDs (stable per index) and MIG UUIDs (new per creation).
        time_scale: multiplies the create/destroy latencies (each GPU's ``latency``,
            default [Villarrubia] Table 1, :mod:`migd.core.costs`); 0 (the default, for tests)
            makes every operation instant; 1.0 is real time. The wait happens outside the
            node lock: other NVML calls go on, MIG changes of the same GPU wait their turn.
        root: whether NVML callers are privileged (``set_root`` changes it later).
        driver_version, cuda_version: what ``nvmlSystemGetDriverVersion`` /
            ``nvmlSystemGetCudaDriverVersion`` report (``"12.4"`` or ``12040``).
        sleep: how latencies are waited for (tests may pass a fake).
        state_file: keep the node's state in this file (``backend.sim_state_file``):
            written atomically after every change, and loaded instead of the
            description's initial contents when it exists. The description must name
            the same GPUs (count, models, UUIDs); its initial instances, processes and
            MIG modes only apply to a node without a saved state.
        host_processes: the host's process table, to drop simulated processes whose
            PID died while the node was down, and MPS servers that exited (default:
            psutil).
        mig_handle_delay: how many MIG device handle lookups
            (``nvmlDeviceGetMigDeviceHandleByIndex``) still answer NOT_FOUND for a new
            compute instance's slot after its creation returned (docs/nvml.md).
        used_memory_visible: ``False``: process listings report ``usedGpuMemory`` as
            unavailable (pynvml: ``None``), as drivers may (nvml.h, ``nvmlProcessInfo_t``).

    Raises:
        ConfigError: no GPUs, or (``where="backend.sim_state_file"``) a state file that
            is corrupt or was written for other GPUs.
        StateStoreError: the state file cannot be written.
    """

    def __init__(
        self,
        gpus: Sequence[SimGpuSpec],
        *,
        seed: int = 0,
        time_scale: float = 0.0,
        root: bool = True,
        driver_version: str = DEFAULT_DRIVER_VERSION,
        cuda_version: int | str = DEFAULT_CUDA_VERSION,
        sleep: Callable[[float], None] = time.sleep,
        state_file: str | Path | None = None,
        host_processes: ProcessTable | None = None,
        mig_handle_delay: int = 0,
        used_memory_visible: bool = True,
    ) -> None:
        if not gpus:
            raise ConfigError("a simulated node needs at least one GPU", where="description")
        self._specs = tuple(gpus)
        self.seed = seed
        self.time_scale = time_scale
        self.driver_version = driver_version
        self.cuda_version = _cuda_version_int(cuda_version)
        self._sleep = sleep
        self._initial_root = root
        self._lock = threading.RLock()
        self._write_done = threading.Condition(self._lock)
        self._writing_gpus: set[int] = set()  # GPUs with a MIG change in progress
        self._costs = [
            CostModel(dict(s.latency)) if s.latency else CostModel.for_model(s.model or "H100")
            for s in self._specs
        ]
        self.call_counts: Counter[str] = Counter()
        self._serials = 0
        self.state_file = Path(state_file) if state_file is not None else None
        self._host = host_processes if host_processes is not None else PsutilProcessTable()
        self.mig_handle_delay = mig_handle_delay
        self.used_memory_visible = used_memory_visible
        self._left_behind = LEFT_BEHIND_FIRST_PID
        self.loaded_from_file = False  # True: the state came from state_file, not the description
        self.pruned_on_load: list[SimProcess] = []  # processes dropped by the load (dead PIDs)
        self._persist_paused = 1  # nothing is written before the node is complete
        self.reset()
        if self.state_file is not None:
            with self._lock:
                saved = persist.read_state(self.state_file)
                if saved is not None:
                    self._restore(saved, self.state_file)
                    self.loaded_from_file = True
                persist.remove_stale_temps(self.state_file)
        self._persist_paused = 0
        self._persist()

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_description(
        cls, description: str | Path, *, state_file: str | Path | None = None, **options: Any
    ) -> SimNode:
        """Build a node from ``"8xA100-40GB"``, a mixed list, TOML text/file or a probe JSON.

        ``state_file`` makes the node persistent (see the class); ``options`` (``seed``,
        ``time_scale``, ``root``, ...) override the source's.

        Raises:
            ConfigError: the description is malformed or names an unknown model, or the
                state file is corrupt or belongs to other GPUs.
            StateStoreError: the state file cannot be written.
        """
        parsed = parse_source(description)
        return cls(parsed.gpus, **{**parsed.options, **options, "state_file": state_file})

    @classmethod
    def from_probe(
        cls, path: str | Path, *, with_processes: bool = True, **options: Any
    ) -> SimNode:
        """Build a node that reproduces a ``scripts/gpu_probe.py`` record.

        Raises:
            ConfigError: the file is not a probe record or lacks the data needed.
        """
        parsed = parse_probe(read_json(Path(path)), where=str(path), with_processes=with_processes)
        return cls(parsed.gpus, **{**parsed.options, **options})

    def reset(self) -> None:
        """Back to the initial state: same GPUs, instances, processes, UUIDs and modes.

        Also clears injected faults, lost GPUs and the call counters. With a state file,
        the file then holds this initial state.
        """
        with self._lock:
            self._persist_paused += 1
            try:
                self._reset_unsaved()
            finally:
                self._persist_paused -= 1
            self._persist()

    def _reset_unsaved(self) -> None:
        with self._lock:
            self._rng = random.Random(self.seed)
            self._root = self._initial_root
            self._injected: list[_Injected] = []
            self._processes: dict[int, SimProcess] = {}
            self._gi_by_serial: dict[int, tuple[SimGpu, SimGpuInstance]] = {}
            self._ci_by_serial: dict[int, tuple[SimGpu, SimGpuInstance, SimComputeInstance]] = {}
            self._by_uuid: dict[str, tuple[SimGpu, SimGpuInstance, SimComputeInstance]] = {}
            self.call_counts.clear()
            self.gpus: list[SimGpu] = []
            for index, spec in enumerate(self._specs):
                self.gpus.append(self._new_gpu(index, spec))
            for gpu in self.gpus:
                self._populate(gpu)

    def _new_gpu(self, index: int, spec: SimGpuSpec) -> SimGpu:
        stable = random.Random(f"{self.seed}:gpu:{index}")
        mig_current = spec.mig_current if spec.geometry is not None else None
        mig_pending = (
            None
            if spec.geometry is None
            else spec.mig_pending
            if spec.mig_pending is not None
            else spec.mig_current
        )
        return SimGpu(
            index=index,
            spec=spec,
            uuid=spec.uuid or f"GPU-{uuid_module.UUID(int=stable.getrandbits(128), version=4)}",
            pci_bus_id=spec.pci_bus_id or f"00000000:{0x07 + 0x10 * index:02X}:00.0",
            mig_current=mig_current,
            mig_pending=mig_pending,
        )

    def _populate(self, gpu: SimGpu) -> None:
        where = f"gpu[{gpu.index}]"
        for inst in gpu.spec.instances:
            if gpu.geometry is None or not gpu.mig_current:
                raise ConfigError("instances need a GPU with MIG enabled", where=where)
            try:
                profile = gpu.geometry.profile(inst.profile)
            except UnknownProfile as err:
                raise ConfigError(err.message, where=where, hint=err.hint) from err
            refusal = self._refusal(gpu, profile, inst.start, profile.memory_slices)
            if refusal is not None:
                raise ConfigError(
                    f"instance {profile.name}@{inst.start} is not placeable: "
                    f"{api.error_name(refusal)}",
                    where=where,
                )
            if inst.gi_id is not None and inst.gi_id in gpu.instances:
                raise ConfigError(f"GPU instance id {inst.gi_id} given twice", where=where)
            computes = (
                ((profile.compute_slices, inst.uuid),)
                if inst.compute_instances is None
                else inst.compute_instances
            )
            given = [mig for _slices, mig in computes if mig is not None]
            for n, mig in enumerate(given):
                if not mig.startswith("MIG-"):
                    raise ConfigError(f"{mig!r} is not a MIG UUID (MIG-...)", where=where)
                if (
                    mig in self._by_uuid
                    or mig in given[:n]
                    or any(g.uuid == mig for g in self.gpus)
                ):
                    raise ConfigError(f"MIG UUID {mig} is given twice", where=where)
            if sum(slices for slices, _ in computes) > profile.compute_slices:
                raise ConfigError(
                    f"the compute instances of {profile.name}@{inst.start} need more than its "
                    f"{profile.compute_slices} compute slices",
                    where=where,
                )
            gi = self._add_gi(gpu, profile, inst.start, gi_id=inst.gi_id)
            for slices, uuid in computes:
                index = next((i for i, n in CI_PROFILE_SLICES.items() if n == slices), None)
                if index is None:
                    raise ConfigError(
                        f"no compute instance profile has {slices} slices", where=where
                    )
                try:
                    self.ci_profile(gi, index)
                except api.NVMLError as exc:
                    raise ConfigError(
                        f"{profile.name} cannot hold a {slices}-slice compute instance",
                        where=where,
                    ) from exc
                self._add_ci(gpu, gi, index, uuid=uuid)
        for proc in gpu.spec.processes:
            device = self._spec_device_uuid(gpu, proc, where)
            self.attach(proc.pid, device, proc.mps_pinned_limit_mib, mps=proc.mps)
            if proc.used_mib:
                self.alloc(proc.pid, proc.used_mib)

    def _spec_device_uuid(self, gpu: SimGpu, proc: SimProcessSpec, where: str) -> str:
        if proc.device == "gpu":
            return gpu.uuid
        if proc.device.startswith(("MIG-", "GPU-")):
            return proc.device
        profile_ref, _, start = proc.device.rpartition("@")
        if gpu.geometry is None or not start.isdigit():
            raise ConfigError(
                f"process device {proc.device!r} is not 'gpu', a UUID or '<profile>@<start>'",
                where=where,
            )
        profile = gpu.geometry.profile(profile_ref)
        for gi in gpu.instances.values():
            if gi.profile.profile_id == profile.profile_id and gi.start == int(start) and gi.cis:
                return gi.cis[min(gi.cis)].uuid
        raise ConfigError(f"no instance {proc.device} for pid {proc.pid}", where=where)

    # -- inspection ---------------------------------------------------------------------------

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    @property
    def is_root(self) -> bool:
        return self._root

    def gpu(self, index: int) -> SimGpu:
        """The live state of GPU ``index`` (read it under no assumption of stability)."""
        return self.gpus[index]

    def placements(self, index: int) -> frozenset[tuple[int, int]]:
        """``{(profile_id, start), ...}`` of GPU ``index`` now."""
        with self._lock:
            return frozenset(
                (gi.profile.profile_id, gi.start) for gi in self.gpus[index].instances.values()
            )

    def instances(self, index: int) -> list[InstanceView]:
        """The GPU instances of GPU ``index``, by start."""
        with self._lock:
            return [
                InstanceView(
                    gi_id=gi.gi_id,
                    profile_id=gi.profile.profile_id,
                    profile_name=gi.profile.name,
                    start=gi.start,
                    size=gi.size,
                    ci_ids=tuple(sorted(gi.cis)),
                    uuids=tuple(ci.uuid for _, ci in sorted(gi.cis.items())),
                )
                for gi in sorted(self.gpus[index].instances.values(), key=lambda g: g.start)
            ]

    def can_create(self, index: int, profile_id: int, start: int) -> bool:
        """Whether the driver would accept ``profile_id`` at ``start`` on GPU ``index`` now.

        Answers from the simulator's own rules (not :mod:`migd.core.states`); tests compare
        the two on every state.
        """
        with self._lock:
            gpu = self.gpus[index]
            if gpu.geometry is None or not gpu.mig_current:
                return False
            profile = next((p for p in gpu.geometry.profiles if p.profile_id == profile_id), None)
            return (
                profile is not None
                and self._refusal(gpu, profile, start, profile.memory_slices) is None
            )

    def remaining_capacity(self, index: int, profile: Profile) -> int:
        """How many more instances of ``profile`` the driver would accept now, all together.

        Used for ``nvmlDeviceGetGpuInstanceRemainingCapacity``: instances are added at the
        profile's legal starts in order until the driver's rules refuse (the published
        placements are aligned, so first-fit packs as many as any order would).
        """
        with self._lock:
            gpu = self.gpus[index]
            added: list[SimGpuInstance] = []
            try:
                for start in profile.starts:
                    if self._refusal(gpu, profile, start, profile.memory_slices) is None:
                        # A placeholder the rules count; removed below, never persisted.
                        placeholder = SimGpuInstance(
                            -1 - len(added), -1 - len(added), profile, start
                        )
                        gpu.instances[placeholder.gi_id] = placeholder
                        added.append(placeholder)
            finally:
                for placeholder in added:
                    del gpu.instances[placeholder.gi_id]
            return len(added)

    def mig_devices(self, index: int) -> dict[int, tuple[SimGpuInstance, SimComputeInstance]]:
        """GPU ``index``'s MIG devices by their index under the parent (holes are empty slots)."""
        with self._lock:
            return {
                ci.mig_index: (gi, ci)
                for gi in self.gpus[index].instances.values()
                for ci in gi.cis.values()
            }

    def mig_device_at(
        self, index: int, mig_index: int
    ) -> tuple[SimGpuInstance, SimComputeInstance] | None:
        """The MIG device in slot ``mig_index`` as ``nvmlDeviceGetMigDeviceHandleByIndex``
        sees it: ``None`` for an empty slot, and for a new device whose handle has not
        appeared yet (each such lookup counts down ``mig_handle_delay``)."""
        with self._lock:
            found = self.mig_devices(index).get(mig_index)
            if found is not None and found[1].hidden_lookups > 0:
                found[1].hidden_lookups -= 1
                return None
            return found

    def max_mig_devices(self, index: int) -> int:
        """``nvmlDeviceGetMaxMigDeviceCount``: one per compute slice at most; 0 without MIG."""
        gpu = self.gpus[index]
        if gpu.geometry is None or not gpu.mig_current:
            return 0
        return gpu.geometry.compute_slices

    def process(self, pid: int) -> SimProcess | None:
        with self._lock:
            return self._processes.get(pid)

    # -- fault injection -------------------------------------------------------------------

    def fail_next(self, call: str, code: int, *, times: int = 1, gpu: int | None = None) -> None:
        """Make the next ``times`` calls of the pynvml function ``call`` fail with ``code``.

        ``gpu`` restricts the fault to calls about that GPU. Example:
        ``node.fail_next("nvmlGpuInstanceDestroy", NVML_ERROR_IN_USE, times=2)``
        models DCGM holding a handle for two attempts.
        """
        with self._lock:
            self._injected.append(_Injected(call, code, times, gpu))

    def lose_gpu(self, index: int) -> None:
        """GPU ``index`` falls off the bus: every NVML call about it fails with GPU_IS_LOST."""
        with self._lock:
            self.gpus[index].lost = True
            self._persist()

    def set_root(self, root: bool) -> None:
        """Privileged or not: without root, MIG writes and privileged reads get NO_PERMISSION."""
        with self._lock:
            self._root = root

    def set_mig_mode(self, index: int, current: bool, pending: bool | None = None) -> None:
        """Set MIG mode as after ``nvidia-smi -mig`` (+ reset when ``pending == current``).

        Raises:
            ValueError: the GPU has no MIG, or instances exist while disabling it.
        """
        with self._lock:
            gpu = self.gpus[index]
            if gpu.geometry is None:
                raise ValueError(f"GPU {index} ({gpu.spec.name}) has no MIG")
            if not current and gpu.instances:
                raise ValueError(f"GPU {index} has MIG instances; destroy them first")
            gpu.mig_current = current
            gpu.mig_pending = current if pending is None else pending
            self._persist()

    def check_call(self, call: str, gpu: int | None = None, *, privileged: bool = False) -> None:
        """Count the call, then raise an injected fault, GPU_IS_LOST or NO_PERMISSION.

        Used by :class:`FakePynvml` at the start of every function.
        """
        with self._lock:
            self.call_counts[call] += 1
            for fault in self._injected:
                if fault.call == call and (fault.gpu is None or fault.gpu == gpu):
                    fault.times -= 1
                    if fault.times <= 0:
                        self._injected.remove(fault)
                    raise api.NVMLError(fault.code)
            if gpu is not None and self.gpus[gpu].lost:
                # nvml.h: NVML_ERROR_GPU_IS_LOST "if the target GPU has fallen off the bus".
                raise api.NVMLError(api.NVML_ERROR_GPU_IS_LOST)
            if privileged and not self._root:
                # nvml.h: MIG create/destroy/list calls "Require privileged user" and
                # return NVML_ERROR_NO_PERMISSION otherwise.
                raise api.NVMLError(api.NVML_ERROR_NO_PERMISSION)

    # -- MIG operations (called by FakePynvml with the NVML argument conventions) -------------

    def require_mig(self, gpu: SimGpu) -> Geometry:
        """The GPU's geometry if MIG is enabled now, else NVML's NOT_SUPPORTED."""
        if gpu.geometry is None or not gpu.mig_current:
            # nvml.h: instance calls return NVML_ERROR_NOT_SUPPORTED "If device doesn't have
            # MIG mode enabled" (and for GPUs without MIG).
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)
        return gpu.geometry

    def create_gpu_instance(
        self, index: int, profile_id: int, start: int, size: int
    ) -> SimGpuInstance:
        """``nvmlDeviceCreateGpuInstanceWithPlacement`` semantics.

        Raises:
            NVMLError: NOT_SUPPORTED (MIG off), INVALID_ARGUMENT (unknown profile, illegal
                start or size), INSUFFICIENT_RESOURCES (overlap, instance limit, shared cap).
        """
        with self._writing(index):
            with self._lock:
                gpu = self.gpus[index]
                geometry = self.require_mig(gpu)
                profile = next((p for p in geometry.profiles if p.profile_id == profile_id), None)
                if profile is None:
                    # nvml.h: INVALID_ARGUMENT "If device, profile, profileId, placement or
                    # gpuInstance are invalid".
                    raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
                refusal = self._refusal(gpu, profile, start, size)
                if refusal is not None:
                    raise api.NVMLError(refusal)
            self._pause(self._costs[index].create_s(profile.compute_slices))
            with self._lock:
                # Only this GPU's MIG writes are held off; check again what they cannot see.
                refusal = self._refusal(gpu, profile, start, size) if gpu.mig_current else None
                if not gpu.mig_current or refusal is not None:
                    raise api.NVMLError(refusal or api.NVML_ERROR_NOT_SUPPORTED)
                gi = self._add_gi(gpu, profile, start)
                self._persist()
                return gi

    def _refusal(self, gpu: SimGpu, profile: Profile, start: int, size: int) -> int | None:
        """Why the driver refuses ``profile`` at ``start`` now (an NVML code), or None."""
        if start not in profile.starts or size != profile.memory_slices:
            # nvml.h: INVALID_ARGUMENT if the placement is invalid.
            return api.NVML_ERROR_INVALID_ARGUMENT
        wanted = set(range(start, start + size))
        existing = list(gpu.instances.values())
        taken: set[int] = set()
        for gi in existing:
            taken |= gi.units
        if wanted & taken:
            # NVML_ERROR_INSUFFICIENT_RESOURCES "If the requested GPU instance could not be
            # created"; placement collisions report it too (NVIDIA/k8s-dra-driver-gpu
            # cmd/gpu-kubelet-plugin/nvlib.go, reference §5.3), not "already exists".
            return api.NVML_ERROR_INSUFFICIENT_RESOURCES
        if sum(gi.profile.profile_id == profile.profile_id for gi in existing) >= (
            profile.max_instances
        ):
            return api.NVML_ERROR_INSUFFICIENT_RESOURCES
        geometry = gpu.geometry
        assert geometry is not None
        for group in geometry.exclusive_groups:
            if profile.profile_id in group.profile_ids:
                members = sum(gi.profile.profile_id in group.profile_ids for gi in existing)
                if members + 1 > group.max_instances:
                    return api.NVML_ERROR_INSUFFICIENT_RESOURCES
        budget = geometry.engine_budget
        if budget and profile.engines is not None:
            for engine, cap in budget.items():
                used = sum((gi.profile.engines or {}).get(engine, 0) for gi in existing)
                if used + profile.engines.get(engine, 0) > cap:
                    return api.NVML_ERROR_INSUFFICIENT_RESOURCES
        return None

    def _add_gi(
        self, gpu: SimGpu, profile: Profile, start: int, gi_id: int | None = None
    ) -> SimGpuInstance:
        geometry = gpu.geometry
        assert geometry is not None
        if gi_id is None:
            gi_id = placement_gi_id(geometry.units, profile.memory_slices, start)
            if gi_id in gpu.instances:  # a geometry the rule does not fit: any free id
                gi_id = _lowest_free(gpu.instances, 1)
        self._serials += 1
        gi = SimGpuInstance(self._serials, gi_id, profile, start)
        gpu.instances[gi_id] = gi
        self._gi_by_serial[gi.serial] = (gpu, gi)
        return gi

    def destroy_gpu_instance(self, gi_serial: int) -> None:
        """``nvmlGpuInstanceDestroy``: IN_USE while compute instances exist.

        Raises:
            NVMLError: INVALID_ARGUMENT (stale handle), IN_USE.
        """
        with self._lock:
            gpu, _gi = self.lookup_gi(gi_serial)
        with self._writing(gpu.index):
            with self._lock:
                gpu, gi = self.lookup_gi(gi_serial)  # it may have gone while we waited
                self.require_mig(gpu)
                if gi.cis:
                    # nvml.h: IN_USE "if processes (e.g. CUDA application) or compute
                    # instances are active on the GPU instance".
                    raise api.NVMLError(api.NVML_ERROR_IN_USE)
            self._pause(self._costs[gpu.index].destroy_s(gi.profile.compute_slices))
            with self._lock:
                if self._gi_by_serial.get(gi.serial) is None:  # reset() meanwhile
                    raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
                del gpu.instances[gi.gi_id]
                del self._gi_by_serial[gi.serial]
                self._persist()

    def lookup_gi(self, gi_serial: int) -> tuple[SimGpu, SimGpuInstance]:
        """A live GPU instance by handle serial (INVALID_ARGUMENT for a stale handle)."""
        found = self._gi_by_serial.get(gi_serial)
        if found is None:
            # nvml.h: INVALID_ARGUMENT "If gpuInstance is invalid" (destroyed: handle invalid).
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
        return found

    def lookup_ci(self, ci_serial: int) -> tuple[SimGpu, SimGpuInstance, SimComputeInstance]:
        found = self._ci_by_serial.get(ci_serial)
        if found is None:
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
        return found

    def ci_profile(self, gi: SimGpuInstance, profile_index: int) -> tuple[int, int]:
        """(slices, instance count) of CI profile ``profile_index`` inside ``gi``.

        Raises:
            NVMLError: INVALID_ARGUMENT past the enum, NOT_SUPPORTED where the GI
                cannot host it (nvml.h: "If profile isn't supported").
        """
        if not 0 <= profile_index < api.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
        slices = CI_PROFILE_SLICES.get(profile_index)
        gi_slices = gi.profile.compute_slices
        if slices is None or slices > gi_slices or (slices > 4 and slices != gi_slices):
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)
        return slices, gi_slices // slices

    def create_compute_instance(self, gi_serial: int, profile_index: int) -> SimComputeInstance:
        """``nvmlGpuInstanceCreateComputeInstance`` (profile ID == CI profile index here).

        Raises:
            NVMLError: NOT_SUPPORTED, INSUFFICIENT_RESOURCES (compute slices used up).
        """
        with self._lock:
            gpu, _gi = self.lookup_gi(gi_serial)
        with self._writing(gpu.index), self._lock:
            gpu, gi = self.lookup_gi(gi_serial)
            slices, _count = self.ci_profile(gi, profile_index)
            if sum(ci.slices for ci in gi.cis.values()) + slices > gi.profile.compute_slices:
                raise api.NVMLError(api.NVML_ERROR_INSUFFICIENT_RESOURCES)
            ci = self._add_ci(gpu, gi, profile_index)
            self._persist()
            return ci

    def _add_ci(
        self,
        gpu: SimGpu,
        gi: SimGpuInstance,
        profile_index: int,
        uuid: str | None = None,
        ci_id: int | None = None,
    ) -> SimComputeInstance:
        self._serials += 1
        taken = {c.mig_index: c for g in gpu.instances.values() for c in g.cis.values()}
        ci = SimComputeInstance(
            serial=self._serials,
            ci_id=_lowest_free(gi.cis, 0) if ci_id is None else ci_id,
            profile_index=profile_index,
            slices=CI_PROFILE_SLICES[profile_index],
            uuid=uuid or f"MIG-{uuid_module.UUID(int=self._rng.getrandbits(128), version=4)}",
            mig_index=_lowest_free(taken, 0),
            hidden_lookups=self.mig_handle_delay if uuid is None else 0,
        )
        gi.cis[ci.ci_id] = ci
        self._ci_by_serial[ci.serial] = (gpu, gi, ci)
        self._by_uuid[ci.uuid] = (gpu, gi, ci)
        return ci

    def destroy_compute_instance(self, ci_serial: int) -> None:
        """``nvmlComputeInstanceDestroy``: IN_USE while a process uses the MIG device.

        Raises:
            NVMLError: INVALID_ARGUMENT (stale handle), IN_USE.
        """
        with self._lock:
            gpu, _gi, _ci = self.lookup_ci(ci_serial)
        with self._writing(gpu.index), self._lock:
            _gpu, gi, ci = self.lookup_ci(ci_serial)
            self._drop_exited_servers()
            if any(p.ci_serial == ci.serial for p in self._processes.values()):
                # nvml.h: IN_USE "if processes (e.g. CUDA application) are active on the
                # compute instance".
                raise api.NVMLError(api.NVML_ERROR_IN_USE)
            del gi.cis[ci.ci_id]
            del self._ci_by_serial[ci.serial]
            del self._by_uuid[ci.uuid]
            self._persist()

    @contextlib.contextmanager
    def _writing(self, index: int) -> Iterator[None]:
        """Hold off other MIG changes of GPU ``index`` (the driver serialises them).

        Only writers of the same GPU wait; reads of every GPU, and writes of the others,
        go on, as NVML's do while an instance is being created.
        """
        with self._write_done:
            while index in self._writing_gpus:
                self._write_done.wait()  # releases the node lock while waiting
            self._writing_gpus.add(index)
        try:
            yield
        finally:
            with self._write_done:
                self._writing_gpus.discard(index)
                self._write_done.notify_all()

    def _pause(self, seconds: float) -> None:
        """Wait out an NVML latency. Called without the node lock: readers see the state
        before the operation until it completes at once, as with a real driver call."""
        if self.time_scale > 0 and seconds > 0:
            self._sleep(seconds * self.time_scale)

    # -- memory and processes -----------------------------------------------------------------

    def memory_mib(self, index: int, gi_serial: int | None = None) -> tuple[int, int]:
        """(total, used by processes) MiB of the whole GPU or of one GPU instance.

        NVML reports :meth:`reserved_mib` on top (``nvmlDeviceGetMemoryInfo``), and a
        CUDA allocation must fit beside both.
        """
        with self._lock:
            gpu = self.gpus[index]
            if gi_serial is None:
                used = sum(p.used_mib for p in self._processes.values() if p.gpu == index)
                return gpu.spec.memory_total_mib, used
            _, gi = self.lookup_gi(gi_serial)
            used = sum(p.used_mib for p in self._processes.values() if p.gi_serial == gi_serial)
            total = gpu.spec.mig_memory_mib.get(gi.profile.name, gi.profile.memory_mib)
            return total, used

    def reserved_mib(self, index: int, gi_serial: int | None = None) -> int:
        """MiB the driver holds on an idle device: ``idle_used_mib`` on a whole GPU,
        ``mig_idle_used_mib`` per GPU instance (a MIG parent adds up its instances')."""
        with self._lock:
            gpu = self.gpus[index]
            spec = gpu.spec
            if gi_serial is not None:
                return spec.mig_idle_used_mib
            if gpu.mig_current:
                return spec.mig_idle_used_mib * len(gpu.instances)
            return spec.idle_used_mib

    def processes_on(self, index: int, ci_serial: int | None = None) -> list[SimProcess]:
        """Processes on GPU ``index`` (all of them) or on one MIG device."""
        with self._lock:
            self._drop_exited_servers()
            return [
                p
                for p in self._processes.values()
                if p.gpu == index and (ci_serial is None or p.ci_serial == ci_serial)
            ]

    def attach(
        self,
        pid: int,
        device_uuid: str,
        mps_pinned_limit_mib: int | None = None,
        *,
        mps: bool | None = None,
    ) -> None:
        """Process ``pid`` creates a CUDA context on ``device_uuid`` (a MIG or GPU UUID).

        ``mps_pinned_limit_mib`` makes it an MPS client with that pinned-memory limit
        (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``); ``mps=True`` makes it an MPS client
        without a limit.

        Raises:
            SimCudaError: the UUID names no usable device (e.g. a MIG-mode parent GPU,
                which CUDA cannot use), or the GPU is lost.
            ValueError: ``pid`` already has a context.
        """
        with self._lock:
            if pid in self._processes:
                raise ValueError(f"pid {pid} is already attached")
            found = self._by_uuid.get(device_uuid)
            if found is not None:
                gpu, gi, ci = found
                proc = SimProcess(pid, gpu.index, gi.serial, ci.serial, device_uuid)
            else:
                gpu_match = next((g for g in self.gpus if g.uuid == device_uuid), None)
                if gpu_match is None:
                    raise SimCudaError(f"CUDA error: invalid device ordinal ({device_uuid})")
                if gpu_match.mig_current:
                    # With MIG on, CUDA enumerates MIG devices only; the parent is not usable.
                    raise SimCudaError(
                        "CUDA error: no CUDA-capable device is detected "
                        f"({device_uuid} is in MIG mode)"
                    )
                gpu = gpu_match
                proc = SimProcess(pid, gpu.index, None, None, device_uuid)
            if gpu.lost:
                raise SimCudaError("CUDA error: unspecified launch failure (GPU is lost)")
            proc.mps = bool(mps) if mps is not None else mps_pinned_limit_mib is not None
            proc.mps_pinned_limit_mib = mps_pinned_limit_mib
            if self.state_file is not None:
                proc.host_start_s = self._host.start_time(pid)
            self._processes[pid] = proc
            self._persist()

    def track_mps_servers(self, device_uuid: str, pids: Iterable[int]) -> None:
        """MPS servers run on ``device_uuid`` (a GPU or MIG UUID): each is an NVML compute
        process there until its host process exits.

        "The MPS server ... creates the shared GPU context" and clients are listed
        against it (docs.nvidia.com/deploy/mps, "Architecture"); NVML lists the server
        on the device it runs on, so a MIG instance that hosted MPS is IN_USE until the
        server has exited, which happens a moment after its control daemon's ``quit``.
        The simulated server holds :data:`MPS_SERVER_USED_MIB` (unknown on real GPUs
        until a probe records one). Known PIDs are ignored; a PID that is not a live
        host process is not added.

        Raises:
            SimCudaError: the UUID names no usable device.
        """
        with self._lock:
            for pid in pids:
                if pid in self._processes or not self._host.alive(pid):
                    continue
                self.attach(pid, device_uuid)
                proc = self._processes[pid]
                proc.mps_server = True
                proc.used_mib = MPS_SERVER_USED_MIB
                proc.host_start_s = self._host.start_time(pid)
            self._persist()

    def _drop_exited_servers(self) -> None:
        gone = [
            pid
            for pid, proc in self._processes.items()
            if proc.mps_server and not self._host.alive(pid, proc.host_start_s)
        ]
        for pid in gone:
            del self._processes[pid]
        if gone:
            self._persist()

    def leave_behind(self, device_uuid: str, used_mib: int) -> int:
        """A process that outlives its lease: it holds ``used_mib`` on ``device_uuid`` until
        :meth:`detach` (e.g. a job's child that escaped the wrapper's kill).

        Real GPUs keep such a process's context and memory whatever migd's books say; the
        daemon must then quarantine the instance, never destroy or reuse it. The PID is
        a purely simulated one (above Linux's largest ``pid_max``, 2^22), so it is never
        a host process; a node reloaded from ``state_file`` drops it like any dead PID.

        Returns:
            the process's PID.

        Raises:
            SimCudaError: the UUID names no usable device.
            SimOutOfMemory: ``used_mib`` does not fit on the device.
        """
        with self._lock:
            self._left_behind += 1
            pid = self._left_behind
            self.attach(pid, device_uuid)
            try:
                self.alloc(pid, used_mib)
            except SimCudaError:
                self.detach(pid)
                raise
            return pid

    def alloc(self, pid: int, mib: int) -> None:
        """``cudaMalloc`` of ``mib`` MiB by ``pid``.

        Raises:
            SimOutOfMemory: past the MPS client's pinned limit, or past the device's
                memory (MIG instance memory, or the whole GPU without MIG).
            ValueError: ``pid`` is not attached or ``mib`` is negative.
        """
        if mib < 0:
            raise ValueError("allocation size must not be negative")
        with self._lock:
            proc = self._attached(pid)
            if self.gpus[proc.gpu].lost:
                raise SimCudaError("CUDA error: unspecified launch failure (GPU is lost)")
            limit = proc.mps_pinned_limit_mib
            if limit is not None and proc.used_mib + mib > limit:
                raise SimOutOfMemory(
                    pid=pid,
                    device_uuid=proc.device_uuid,
                    requested_mib=mib,
                    used_mib=proc.used_mib,
                    limit_mib=limit,
                    limit="MPS pinned-memory limit",
                )
            total, used = self.memory_mib(proc.gpu, proc.gi_serial)
            used += self.reserved_mib(proc.gpu, proc.gi_serial)
            if used + mib > total:
                raise SimOutOfMemory(
                    pid=pid,
                    device_uuid=proc.device_uuid,
                    requested_mib=mib,
                    used_mib=used,
                    limit_mib=total,
                    limit="device memory",
                )
            proc.used_mib += mib
            self._persist()

    def free(self, pid: int, mib: int) -> None:
        """``cudaFree`` of ``mib`` MiB.

        Raises:
            ValueError: more than the process holds, or not attached.
        """
        with self._lock:
            proc = self._attached(pid)
            if not 0 <= mib <= proc.used_mib:
                raise ValueError(f"pid {pid} holds {proc.used_mib} MiB, cannot free {mib}")
            proc.used_mib -= mib
            self._persist()

    def detach(self, pid: int) -> None:
        """The process exits: its context and memory go away (no error if not attached)."""
        with self._lock:
            if self._processes.pop(pid, None) is not None:
                self._persist()

    def _attached(self, pid: int) -> SimProcess:
        proc = self._processes.get(pid)
        if proc is None:
            raise ValueError(f"pid {pid} has no CUDA context on this node")
        return proc

    # -- persistence (state_file) -------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The node's state as JSON-ready data: what ``state_file`` holds.

        Per GPU: identity (model, name, UUID, checked against the description on load),
        MIG mode (current and pending), lost or not, and every GPU instance with its GI
        id, profile, placement start and compute instances (CI id, CI profile, MIG
        UUID). Per process: PID, device, the instance it runs on (GI/CI id), memory in
        use, MPS settings and the host start time of its PID. Plus the id counters:
        the handle serial and the MIG UUID generator's state, so a reloaded node never
        hands out a MIG UUID it handed out before.

        Not kept (they are not GPU state): injected faults, call counters, ``set_root``.
        """
        with self._lock:
            version, internal, gauss = self._rng.getstate()
            return {
                "schema": persist.SIM_STATE_SCHEMA,
                "seed": self.seed,
                "next_serial": self._serials,
                "mig_uuid_rng": [version, list(internal), gauss],
                "gpus": [
                    {
                        "index": gpu.index,
                        "model": gpu.spec.model,
                        "name": gpu.spec.name,
                        "uuid": gpu.uuid,
                        "mig_current": gpu.mig_current,
                        "mig_pending": gpu.mig_pending,
                        "lost": gpu.lost,
                        "instances": [
                            {
                                "gi_id": gi.gi_id,
                                "profile_id": gi.profile.profile_id,
                                "start": gi.start,
                                "cis": [
                                    {
                                        "ci_id": ci.ci_id,
                                        "profile_index": ci.profile_index,
                                        "uuid": ci.uuid,
                                    }
                                    for _, ci in sorted(gi.cis.items())
                                ],
                            }
                            for _, gi in sorted(gpu.instances.items())
                        ],
                    }
                    for gpu in self.gpus
                ],
                "processes": [
                    {
                        "pid": proc.pid,
                        "gpu": proc.gpu,
                        "gi_id": self._gi_by_serial[proc.gi_serial][1].gi_id
                        if proc.gi_serial is not None
                        else None,
                        "ci_id": self._ci_by_serial[proc.ci_serial][2].ci_id
                        if proc.ci_serial is not None
                        else None,
                        "device_uuid": proc.device_uuid,
                        "used_mib": proc.used_mib,
                        "mps": proc.mps,
                        "mps_pinned_limit_mib": proc.mps_pinned_limit_mib,
                        "host_start_s": proc.host_start_s,
                        "mps_server": proc.mps_server,
                    }
                    for _, proc in sorted(self._processes.items())
                ],
            }

    def _persist(self) -> None:
        """Write the state to ``state_file`` (under the node lock, so writes are ordered)."""
        if self.state_file is None or self._persist_paused:
            return
        with self._lock:
            payload = persist.encode_state(self.snapshot())
            try:
                persist.write_atomic(self.state_file, payload)
            except OSError as exc:
                raise StateStoreError(
                    f"cannot save the simulated GPUs' state to {self.state_file}: "
                    f"{exc.strerror or exc}",
                    hint=(
                        "make the directory writable and give it free space; until then the "
                        "file holds an older state than the simulated GPUs"
                    ),
                    path=str(self.state_file),
                ) from exc

    def _restore(self, saved: dict[str, Any], path: Path) -> None:
        """Replace the description's initial state by ``saved`` (see :meth:`snapshot`).

        Everything is checked as the driver would: placements legal, ids unique,
        compute slices and memory within the instance's. Processes whose PID no longer
        runs on the host (or runs a different process) are dropped into
        :attr:`pruned_on_load`: a dead process's CUDA context is gone.

        Raises:
            ConfigError: ``saved`` was written for other GPUs, or is inconsistent.
        """
        try:
            self._check_identity(saved["gpus"], path)
            self._restore_checked(saved)
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, MigdError, api.NVMLError) as exc:
            raise persist.corrupt(path, f"{type(exc).__name__}: {exc}") from exc

    def _check_identity(self, saved_gpus: list[dict[str, Any]], path: Path) -> None:
        if not isinstance(saved_gpus, list):
            raise TypeError("'gpus' is not a list")
        if len(saved_gpus) != len(self.gpus):
            raise persist.mismatch(
                path,
                f"the file has {len(saved_gpus)} GPU(s), the description {len(self.gpus)}",
            )
        for gpu, saved in zip(self.gpus, saved_gpus, strict=True):
            if not isinstance(saved, dict):
                raise TypeError(f"gpus[{gpu.index}] is not an object")
            mine = (gpu.spec.model, gpu.spec.name, gpu.uuid)
            theirs = (saved.get("model"), saved.get("name"), saved.get("uuid"))
            if mine != theirs:
                raise persist.mismatch(
                    path,
                    f"GPU {gpu.index} is {_gpu_label(*theirs)} in the file but "
                    f"{_gpu_label(*mine)} in the description",
                )

    def _restore_checked(self, saved: dict[str, Any]) -> None:
        self._processes = {}
        self._gi_by_serial = {}
        self._ci_by_serial = {}
        self._by_uuid = {}
        for gpu, entry in zip(self.gpus, saved["gpus"], strict=True):
            gpu.instances = {}
            gpu.lost = _bool(entry["lost"], "lost")
            if gpu.geometry is None:
                if entry["mig_current"] is not None or entry["mig_pending"] is not None:
                    raise ValueError(f"GPU {gpu.index} has no MIG but a MIG mode is saved")
                gpu.mig_current = gpu.mig_pending = None
            else:
                gpu.mig_current = _bool(entry["mig_current"], "mig_current")
                gpu.mig_pending = _bool(entry["mig_pending"], "mig_pending")
            for inst in entry["instances"]:
                self._restore_instance(gpu, inst)
        for entry in saved["processes"]:
            proc = self._restored_process(entry)
            if proc is None:
                continue
            if not self._host.alive(proc.pid, proc.host_start_s):
                # A dead process's context (and memory) go with it, as on a real GPU.
                self.pruned_on_load.append(proc)
                _log.info(
                    "simulated process %d (%s) no longer runs on the host; dropped on load",
                    proc.pid,
                    proc.device_uuid,
                )
                continue
            self._processes[proc.pid] = proc
        for gpu in self.gpus:
            for gi in gpu.instances.values():
                total, used = self.memory_mib(gpu.index, gi.serial)
                if used > total:
                    raise ValueError(f"processes use {used} MiB of GI {gi.gi_id}'s {total} MiB")
        self._serials = max(self._serials, _int(saved["next_serial"], "next_serial"))
        version, internal, gauss = saved["mig_uuid_rng"]
        self._rng.setstate((int(version), tuple(int(x) for x in internal), gauss))

    def _restore_instance(self, gpu: SimGpu, inst: dict[str, Any]) -> None:
        where = f"GPU {gpu.index}"
        if gpu.geometry is None or not gpu.mig_current:
            raise ValueError(f"{where} has instances but MIG is not enabled")
        profile_id = _int(inst["profile_id"], "profile_id")
        profile = next((p for p in gpu.geometry.profiles if p.profile_id == profile_id), None)
        if profile is None:
            raise ValueError(f"{where} has no profile id {profile_id}")
        start, gi_id = _int(inst["start"], "start"), _int(inst["gi_id"], "gi_id")
        if gi_id in gpu.instances:
            raise ValueError(f"{where}: GPU instance id {gi_id} saved twice")
        refusal = self._refusal(gpu, profile, start, profile.memory_slices)
        if refusal is not None:
            raise ValueError(
                f"{where}: {profile.name}@{start} is not placeable ({api.error_name(refusal)})"
            )
        gi = self._add_gi(gpu, profile, start, gi_id=gi_id)
        for ci_entry in inst["cis"]:
            ci_id = _int(ci_entry["ci_id"], "ci_id")
            profile_index = _int(ci_entry["profile_index"], "profile_index")
            uuid = ci_entry["uuid"]
            if not isinstance(uuid, str) or not uuid.startswith("MIG-"):
                raise ValueError(f"{where}: {uuid!r} is not a MIG UUID")
            if uuid in self._by_uuid:
                raise ValueError(f"{where}: MIG UUID {uuid} saved twice")
            if ci_id in gi.cis:
                raise ValueError(f"{where}: compute instance id {ci_id} saved twice in GI {gi_id}")
            slices, _ = self.ci_profile(gi, profile_index)
            if sum(ci.slices for ci in gi.cis.values()) + slices > profile.compute_slices:
                raise ValueError(f"{where}: GI {gi_id}'s compute instances exceed its slices")
            self._add_ci(gpu, gi, profile_index, uuid=uuid, ci_id=ci_id)

    def _restored_process(self, entry: dict[str, Any]) -> SimProcess | None:
        pid = _int(entry["pid"], "pid")
        if pid in self._processes or any(p.pid == pid for p in self.pruned_on_load):
            raise ValueError(f"pid {pid} saved twice")
        gpu_index = _int(entry["gpu"], "gpu")
        if not 0 <= gpu_index < len(self.gpus):
            raise ValueError(f"pid {pid}: no GPU {gpu_index}")
        gpu = self.gpus[gpu_index]
        device_uuid = entry["device_uuid"]
        gi_serial = ci_serial = None
        if entry["gi_id"] is None:
            if device_uuid != gpu.uuid:
                raise ValueError(f"pid {pid}: {device_uuid!r} is not GPU {gpu.index}")
        else:
            gi = gpu.instances[_int(entry["gi_id"], "gi_id")]
            ci = gi.cis[_int(entry["ci_id"], "ci_id")]
            if device_uuid != ci.uuid:
                raise ValueError(f"pid {pid}: {device_uuid!r} is not the saved MIG device")
            gi_serial, ci_serial = gi.serial, ci.serial
        used_mib = _int(entry["used_mib"], "used_mib")
        raw_limit = entry["mps_pinned_limit_mib"]
        limit = None if raw_limit is None else _int(raw_limit, "mps_pinned_limit_mib")
        start_s = entry["host_start_s"]
        if used_mib < 0 or (limit is not None and used_mib > limit):
            raise ValueError(f"pid {pid}: {used_mib} MiB in use is out of range")
        if start_s is not None and not isinstance(start_s, int | float):
            raise TypeError(f"pid {pid}: host_start_s is not a number")
        return SimProcess(
            pid=pid,
            gpu=gpu.index,
            gi_serial=gi_serial,
            ci_serial=ci_serial,
            device_uuid=device_uuid,
            used_mib=used_mib,
            mps=_bool(entry["mps"], "mps"),
            mps_pinned_limit_mib=limit,
            host_start_s=None if start_s is None else float(start_s),
            mps_server=_bool(entry.get("mps_server", False), "mps_server"),
        )

    @property
    def lock(self) -> threading.RLock:
        """The node lock (re-entrant): hold it across calls that need one consistent view."""
        return self._lock


def _int(value: Any, name: str) -> int:
    # bool is an int subclass; a saved true/false where a number belongs is corruption.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} is {value!r}, not an integer")
    return value


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} is {value!r}, not true/false")
    return value


def _gpu_label(model: Any, name: Any, uuid: Any) -> str:
    return f"{model or name} ({uuid})"


def placement_gi_id(units: int, memory_slices: int, start: int) -> int:
    """The GPU instance id the driver gives an instance at ``start``.

    Real GPUs number instances by placement, not by order of creation: the memory slices
    form a binary tree (the whole GPU at the root, id 0; halves 1-2; quarters 3-6; single
    slices 7-14 on an 8-slice GPU), and an instance gets the id of the smallest node that
    covers it. NVIDIA's MIG user guide ("Example 1: Creation of a 4-2-1 geometry",
    A100-40GB) gets id 1 for 4g.20gb at 0, 5 for 2g.10gb at 4 and 13 for 1g.5gb at 6;
    a published H100 ``nvidia-smi mig -lgi`` lists 1g.10gb at starts 0-6 as ids 7-13.
    That the rule holds for every profile and model is inference;
    ``scripts/mig_calibrate.py`` records the ids per placement to settle it.
    """
    span = 1
    while span < memory_slices:
        span *= 2
    leaves = 1
    while leaves < units:
        leaves *= 2
    return leaves // span - 1 + start // span


def _lowest_free(used: dict[int, Any], first: int) -> int:
    candidate = first
    while candidate in used:
        candidate += 1
    return candidate


def _cuda_version_int(version: int | str) -> int:
    if isinstance(version, int):
        return version
    major, _, minor = version.partition(".")
    return int(major) * 1000 + int(minor or 0) * 10


__all__ = [
    "InstanceView",
    "SimCudaError",
    "SimGpu",
    "SimGpuSpec",
    "SimInstanceSpec",
    "SimNode",
    "SimOutOfMemory",
    "SimProcessSpec",
]
