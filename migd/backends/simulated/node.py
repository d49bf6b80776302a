"""A simulated GPU node: what NVML and CUDA programs on it would see. Thread-safe.

:class:`SimNode` keeps the state of every GPU (MIG mode, GPU and compute
instances, processes and their memory) behind one lock, builds it from a description,
answers inspection, injects faults, and composes the parts that change it, each in its
own module:

* ``node.mig`` (:mod:`~migd.backends.simulated.mig_ops`): GPU and compute instances,
  created and destroyed under the driver's placement rules;
* ``node.procs`` (:mod:`~migd.backends.simulated.processes`): CUDA processes, their
  memory, MPS servers;
* :mod:`~migd.backends.simulated.persist`: the state file;
* :mod:`~migd.backends.simulated.state`: the state's data classes.

:class:`~migd.backends.simulated.fake_pynvml.FakePynvml` exposes the node through the
``pynvml`` API; tests also drive it directly (workloads, faults).

With a ``state_file`` the node outlives its process, as real GPUs outlive a
``kill -9`` of the daemon: every change is written to the file atomically
(:mod:`migd.backends.simulated.persist`) and a new node with the same file starts
where the old one stopped. On such a load, simulated processes whose host PID is
gone (or now belongs to another process) are dropped, as the driver drops a dead
process's context; see :func:`~migd.backends.simulated.persist.snapshot`.
"""

from __future__ import annotations

import random
import threading
import time
import uuid as uuid_module
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from migd.backends.procs import PsutilProcessTable
from migd.backends.simulated import nvml_api as api
from migd.backends.simulated import persist
from migd.backends.simulated.mig_ops import CI_PROFILE_SLICES, MigOps
from migd.backends.simulated.processes import Processes, SimCudaError, SimOutOfMemory
from migd.backends.simulated.specs import (
    SimGpuSpec,
    SimInstanceSpec,
    SimProcessSpec,
    parse_probe,
    parse_source,
    read_json,
)
from migd.backends.simulated.state import InstanceView, SimGpu, SimProcess
from migd.errors import ConfigError, UnknownProfile
from migd.ports import ProcessTable

MIB = 1024 * 1024
DEFAULT_DRIVER_VERSION = "580.95.05"
DEFAULT_CUDA_VERSION = 13000  # nvmlSystemGetCudaDriverVersion encoding: 1000*major + 10*minor


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
        self.specs = tuple(gpus)
        self.seed = seed
        self.time_scale = time_scale
        self.driver_version = driver_version
        self.cuda_version = _cuda_version_int(cuda_version)
        self._sleep = sleep
        self._initial_root = root
        self._lock = threading.RLock()
        self.call_counts: Counter[str] = Counter()
        self.state_file = Path(state_file) if state_file is not None else None
        self.mig_handle_delay = mig_handle_delay
        self.used_memory_visible = used_memory_visible
        self.loaded_from_file = False  # True: the state came from state_file, not the description
        self.pruned_on_load: list[SimProcess] = []  # processes dropped by the load (dead PIDs)
        self._persist_paused = 1  # nothing is written before the node is complete
        self.mig = MigOps(self)
        self.procs = Processes(
            self, host_processes if host_processes is not None else PsutilProcessTable()
        )
        self.reset()
        if self.state_file is not None:
            with self._lock:
                saved = persist.read_state(self.state_file)
                if saved is not None:
                    persist.restore(self, saved, self.state_file)
                    self.loaded_from_file = True
                persist.remove_stale_temps(self.state_file)
        self._persist_paused = 0
        self.save()

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
            self.save()

    def _reset_unsaved(self) -> None:
        with self._lock:
            self._root = self._initial_root
            self._injected: list[_Injected] = []
            self.mig.clear()
            self.procs.clear()
            self.call_counts.clear()
            self.gpus: list[SimGpu] = []
            for index, spec in enumerate(self.specs):
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
            refusal = self.mig.refusal(gpu, profile, inst.start, profile.memory_slices)
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
                    mig in self.mig.by_uuid
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
            gi = self.mig.add_gi(gpu, profile, inst.start, gi_id=inst.gi_id)
            for slices, uuid in computes:
                index = next((i for i, n in CI_PROFILE_SLICES.items() if n == slices), None)
                if index is None:
                    raise ConfigError(
                        f"no compute instance profile has {slices} slices", where=where
                    )
                try:
                    self.mig.ci_profile(gi, index)
                except api.NVMLError as exc:
                    raise ConfigError(
                        f"{profile.name} cannot hold a {slices}-slice compute instance",
                        where=where,
                    ) from exc
                self.mig.add_ci(gpu, gi, index, uuid=uuid)
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

    def process(self, pid: int) -> SimProcess | None:
        with self._lock:
            self.procs.drop_dead()
            return self.procs.by_pid.get(pid)

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
            self.save()

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
            self.save()

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

    # -- the node's clock and state file ------------------------------------------------------

    def pause(self, seconds: float) -> None:
        """Wait out an NVML latency. Called without the node lock: readers see the state
        before the operation until it completes at once, as with a real driver call."""
        if self.time_scale > 0 and seconds > 0:
            self._sleep(seconds * self.time_scale)

    def save(self) -> None:
        """Write the state to ``state_file`` (under the node lock, so writes are ordered).

        Raises:
            StateStoreError: the file cannot be written.
        """
        if self.state_file is None or self._persist_paused:
            return
        with self._lock:
            persist.save(self.state_file, self.snapshot())

    def snapshot(self) -> dict[str, Any]:
        """The node's state as JSON-ready data: what ``state_file`` holds
        (:func:`~migd.backends.simulated.persist.snapshot`)."""
        return persist.snapshot(self)

    # -- what CUDA programs do (node.procs; kept here, the calls every workload makes) --------

    def memory_mib(self, index: int, gi_serial: int | None = None) -> tuple[int, int]:
        """(total, used by processes) MiB of the whole GPU or of one GPU instance
        (:meth:`Processes.memory_mib <migd.backends.simulated.processes.Processes.memory_mib>`)."""
        return self.procs.memory_mib(index, gi_serial)

    def attach(
        self,
        pid: int,
        device_uuid: str,
        mps_pinned_limit_mib: int | None = None,
        *,
        mps: bool | None = None,
    ) -> None:
        """Process ``pid`` creates a CUDA context on ``device_uuid`` (:meth:`Processes.attach
        <migd.backends.simulated.processes.Processes.attach>`)."""
        self.procs.attach(pid, device_uuid, mps_pinned_limit_mib, mps=mps)

    def alloc(self, pid: int, mib: int) -> None:
        """``cudaMalloc`` of ``mib`` MiB by ``pid`` (:meth:`Processes.alloc
        <migd.backends.simulated.processes.Processes.alloc>`)."""
        self.procs.alloc(pid, mib)

    def free(self, pid: int, mib: int) -> None:
        """``cudaFree`` of ``mib`` MiB (:meth:`Processes.free
        <migd.backends.simulated.processes.Processes.free>`)."""
        self.procs.free(pid, mib)

    def detach(self, pid: int) -> None:
        """The process exits: its context and memory go away (no error if not attached)."""
        self.procs.detach(pid)

    @property
    def lock(self) -> threading.RLock:
        """The node lock (re-entrant): hold it across calls that need one consistent view."""
        return self._lock


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
