"""The narrow interfaces migd talks to the outside world through.

``main()`` builds the real implementations (or the simulated ones) and passes
them down; nothing else constructs a backend. Every implementation translates
its own errors into :mod:`migd.errors` at its boundary.

Implementations:

* :class:`GpuBackend`: ``migd.backends.nvml.NvmlBackend`` over ``pynvml`` or over
  the simulated ``pynvml`` stand-in (``migd.backends.simulated``).
* :class:`ProcessTable`: ``migd.backends.procs.PsutilProcessTable``.
* :class:`MpsControl`: ``migd.backends.mps.MpsManager`` (real or fake
  ``nvidia-cuda-mps-control``).
* :class:`Clock`: ``SystemClock`` here; tests use a manual clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from migd.core.geometry import Geometry
from migd.core.leases import Lease
from migd.core.mps import MpsShare


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One physical GPU as discovered (``nvidia-smi -q`` has the same facts).

    ``mig_current``/``mig_pending`` are ``None`` on GPUs without MIG support, and
    also when NVML could not say: then ``mig_mode_error`` says why (``None`` means the
    mode was read). A GPU whose MIG mode is unknown must not be given work: it may
    well be a MIG GPU.
    ``model`` is the catalog key (``A100-40GB``) or ``None`` for an unknown model.
    ``persistence_mode``: whether the driver stays initialised while the GPU is idle
    (``None``: NVML could not say); without it an idle GPU can be de-initialised and
    lose its MIG instances. ``compute_mode``: ``"DEFAULT"``, ``"EXCLUSIVE_PROCESS"`` or
    ``"PROHIBITED"`` (``None``: unknown); MPS is only enforced under
    ``EXCLUSIVE_PROCESS`` (docs/mps.md).
    """

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    pci_device_id: int
    memory_total_mib: int
    mig_current: bool | None
    mig_pending: bool | None
    driver_version: str
    cuda_version: str
    model: str | None
    compute_capability: tuple[int, int] | None = None
    mig_mode_error: str | None = None
    persistence_mode: bool | None = None
    compute_mode: str | None = None

    @property
    def mig_mode_known(self) -> bool:
        """False when NVML could not read the MIG mode (see ``mig_mode_error``)."""
        return self.mig_mode_error is None


@dataclass(frozen=True, slots=True)
class ComputeInstance:
    """One compute instance of a GPU instance: one MIG device (``MIG-...``)."""

    ci_id: int
    uuid: str
    slices: int  # compute slices


@dataclass(frozen=True, slots=True)
class MigInstance:
    """A GPU instance and its compute instances.

    migd makes one full-size compute instance per GPU instance; ``ci_id``/``uuid`` are
    that one (the first of ``compute_instances``, by id, where an admin made several;
    ``None`` for a GPU instance without a compute instance). ``compute_instances`` lists
    every compute instance, so an instance made by hand with several MIG devices is seen
    whole.
    ``uuid`` is the MIG device UUID, found through the GPU's MIG device handles
    (``nvmlDeviceGetMigDeviceHandleByIndex``) by GPU and compute instance id.
    """

    gpu: int
    gi_id: int
    profile_id: int
    start: int
    size: int
    memory_total_mib: int
    compute_instances: tuple[ComputeInstance, ...] = ()

    @property
    def ci_id(self) -> int | None:
        return self.compute_instances[0].ci_id if self.compute_instances else None

    @property
    def uuid(self) -> str | None:
        return self.compute_instances[0].uuid if self.compute_instances else None


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A process with a CUDA context on a GPU or MIG device."""

    pid: int
    used_mib: int | None  # None when NVML cannot say (no privileges, some MIG cases)
    gpu: int
    mig_uuid: str | None = None
    mps: bool = False  # listed by nvmlDeviceGetMPSComputeRunningProcesses (an MPS client)


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    total_mib: int
    used_mib: int

    @property
    def free_mib(self) -> int:
        return max(0, self.total_mib - self.used_mib)


@runtime_checkable
class GpuBackend(Protocol):
    """Everything migd asks of the GPUs. One instance per daemon, calls may block.

    The daemon calls each GPU's methods from that GPU's own worker thread only,
    so an implementation needs no locking per GPU; calls for different GPUs may
    run concurrently.
    """

    def discover(self) -> list[GpuInfo]:
        """All GPUs, in NVML index order.

        Raises:
            DriverUnavailable: no NVML library or driver.
        """
        ...

    def geometry(self, gpu: int) -> Geometry:
        """The GPU's MIG geometry, from NVML where it can say, else the built-in tables.

        Raises:
            GpuUnsupported: no MIG on this GPU.
        """
        ...

    def list_instances(self, gpu: int) -> list[MigInstance]:
        """Existing GPU instances with every compute instance and MIG UUID; ``[]`` without MIG."""
        ...

    def create_instance(self, gpu: int, profile_id: int, start: int) -> MigInstance:
        """Create a GPU instance at an explicit placement plus its full compute instance.

        Raises:
            InsufficientResources: the slices are taken.
            GpuPermissionDenied, MigModeError, GpuBusy: see :mod:`migd.errors`.
        """
        ...

    def destroy_instance(self, gpu: int, gi_id: int) -> None:
        """Destroy the compute instance(s), then the GPU instance.

        Every compute instance is checked for processes before any is destroyed, so an
        instance in use is never left half destroyed.

        Raises:
            GpuBusy: processes (on any of its compute instances, or another NVML
                client) still use it.
            InstanceNotFound: no GPU instance with that id.
        """
        ...

    def memory(self, gpu: int, mig_uuid: str | None = None) -> MemoryInfo:
        """Memory of the whole GPU, or of one MIG device."""
        ...

    def processes(self, gpu: int, mig_uuid: str | None = None) -> list[GpuProcess]:
        """Compute processes (incl. MPS clients) on the GPU or on one MIG device."""
        ...

    def heartbeat(self, gpu: int) -> None:
        """A cheap NVML call proving the driver still answers (feeds the watchdog)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class GpuEvent:
    """One NVML event as migd understands it.

    Attributes:
        gpu: NVML index of the GPU.
        kind: ``xid``, ``ecc_dbe`` or ``mig_config``.
        xid: the XID (``xid`` events), else None.
        gi_id, ci_id: the GPU/compute instance NVML attributes the event to, else None.
        critical: the GPU must take no new leases.
        instance_lost: the attributed instance's work is lost (``gi_id`` set), or with
            ``gi_id`` None every instance on the GPU.
        reason: a sentence for status, logs and the jobs.
    """

    gpu: int
    kind: str
    xid: int | None = None
    gi_id: int | None = None
    ci_id: int | None = None
    critical: bool = False
    instance_lost: bool = False
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "kind": self.kind,
            "xid": self.xid,
            "gi_id": self.gi_id,
            "ci_id": self.ci_id,
            "critical": self.critical,
            "instance_lost": self.instance_lost,
            "reason": self.reason,
        }


class EventListener(Protocol):
    """A running listener of :class:`GpuEvents` (:meth:`start` registers the GPUs)."""

    registered: dict[int, int]  # GPU index -> event mask registered
    unsupported: dict[int, str]  # GPU index -> why it has no events

    def start(self) -> None: ...

    def stop(self) -> None: ...


class GpuEvents(Protocol):
    """NVML's event stream (XIDs, ECC; docs/operations.md, GPU health).

    A listener waits in a thread of its own and calls ``on_event`` there with each
    classified event; ``ignore_xids`` are application faults (``health.ignore_xids``).
    Real: :class:`migd.backends.nvml.events.NvmlEvents`; simulated:
    :class:`migd.backends.simulated.nvml_events.SimGpuEvents`.
    """

    def listener(
        self,
        gpus: Iterable[int],
        on_event: Callable[[GpuEvent], None],
        *,
        ignore_xids: Collection[int],
    ) -> EventListener: ...


@runtime_checkable
class ProcessTable(Protocol):
    """The host's processes, for deciding whether a lease holder is still alive."""

    def alive(self, pid: int, start_time: float | None = None) -> bool:
        """True if ``pid`` runs and (when given) started at ``start_time`` (PID reuse guard)."""
        ...

    def start_time(self, pid: int) -> float | None:
        """When the process started (an opaque number in seconds, e.g. since boot, that
        ``alive`` compares), ``None`` if it does not exist."""
        ...

    def uid(self, pid: int) -> int | None: ...

    def parent(self, pid: int) -> int | None:
        """The parent's pid, ``None`` if no such process (to walk a job's process tree)."""
        ...


class MpsAdoption(Protocol):
    """What :meth:`MpsControl.start` found of an earlier migd's MPS daemons."""

    @property
    def adopted(self) -> tuple[str, ...]:
        """Device UUIDs whose live control daemon was taken over."""
        ...

    @property
    def lost(self) -> tuple[str, ...]:
        """Device UUIDs whose recorded daemon had died: their clients are gone."""
        ...


class MpsHealthEvent(Protocol):
    """One problem a health check found and what it did about it."""

    @property
    def device_uuid(self) -> str: ...

    @property
    def detail(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


class MpsHealthReport(Protocol):
    @property
    def events(self) -> tuple[MpsHealthEvent, ...]: ...

    @property
    def affected_devices(self) -> tuple[str, ...]:
        """Devices whose clients were (or may have been) lost."""
        ...

    @property
    def failed_devices(self) -> tuple[str, ...]:
        """Devices that could not be brought back: their GPU takes no new work."""
        ...


class MpsControl(Protocol):
    """The per-device MPS control daemons migd runs (``nvidia-cuda-mps-control -d``).

    Thread-safe: the daemon calls it from each GPU's worker thread and from a pool
    thread for housekeeping. Device UUIDs are a whole GPU's or a MIG instance's.
    Errors are :class:`migd.errors.MigdError` subclasses.
    """

    def start(self) -> MpsAdoption:
        """Adopt live daemons of an earlier migd, clean up dead ones (once, at start-up)."""
        ...

    def share_for(self, lease: Lease) -> MpsShare:
        """The MPS share a lease stands for (id, owner, pinned memory, clients)."""
        ...

    def client_env(self, device_uuid: str, lease: Lease) -> Mapping[str, str]:
        """The job environment for ``lease`` on the device, without starting anything."""
        ...

    def ensure_share(self, device_uuid: str, share: MpsShare) -> Mapping[str, str]:
        """Start the device's daemon if needed and register the share (idempotent)."""
        ...

    def release_share(self, device_uuid: str, share_id: str) -> None:
        """Drop a share; the daemon stops once idle for ``mps.idle_stop_s``."""
        ...

    def manages(self, device_uuid: str) -> bool:
        """Whether a daemon of migd's runs for the device."""
        ...

    def client_count(self, device_uuid: str) -> int:
        """CUDA clients the device's MPS server has (raises when it cannot say)."""
        ...

    def stop_device(self, device_uuid: str) -> None:
        """Stop the device's daemon (before its MIG instance is destroyed)."""
        ...

    def stop_for_teardown(
        self, device_uuid: str, device_pids: Callable[[], Collection[int]]
    ) -> None:
        """Before the device's MIG instance is destroyed: refuse (GpuBusy) while its server
        has clients, stop its daemon, and wait, bounded, until its servers are gone from
        ``device_pids()`` (NVML's processes on the device); GpuBusy if they stay."""
        ...

    def watch_servers(self, watcher: Callable[[str, Collection[int]], None]) -> None:
        """Have ``watcher(device_uuid, server_pids)`` called for servers the manager starts
        (the simulated GPU lists them as compute processes)."""
        ...

    def check_health(self) -> MpsHealthReport:
        """Restart dead daemons and servers; report what was found and done."""
        ...

    def stop_idle(self) -> list[str]:
        """Stop daemons idle for ``mps.idle_stop_s``; return their devices."""
        ...

    def refresh_status(self) -> None:
        """Re-read every daemon's status for :meth:`cached_status_for` (may block)."""
        ...

    def cached_status_for(self, device_uuid: str) -> list[dict[str, Any]]:
        """The device's daemon status as last read (never blocks)."""
        ...

    def report_client_error(self, device_uuid: str, message: str) -> None:
        """A client saw an MPS failure; the next health check acts on it."""
        ...

    def shutdown(self, keep: Collection[str] = ()) -> None:
        """Stop every daemon except those of ``keep`` (devices with active leases)."""
        ...


@dataclass(frozen=True, slots=True)
class CgroupMemoryLimit:
    """A cgroup's device-memory limits on one GPU (``nvmlGetMemoryLimits_v1_t``), in MiB.

    ``hard_mib`` ``None``: no limit (NVML: soft 0, hard ``NVML_DEVICE_MEMORY_LIMIT_MAX``).
    """

    cgroup: str
    soft_mib: int
    hard_mib: int | None
    used_mib: int


class CgroupMemoryLimits(Protocol):
    """Per-cgroup device-memory limits: MPS v3 memory partitioning (driver r615 /
    CUDA 13.4, ``nvmlDeviceSetMemoryLimits_v1`` with a cgroup path; docs/mps.md, "MPS v3").

    Behind detection only: :meth:`support` says whether this GPU can have them; the other
    methods raise :class:`~migd.errors.GpuError` subclasses where NVML refuses.
    """

    def support(self, gpu: int) -> str | None:
        """``None`` if the GPU takes per-cgroup limits, else why not (for ``migctl``)."""
        ...

    def set_limit(self, gpu: int, cgroup: str, hard_mib: int, soft_mib: int = 0) -> None:
        """Limit what the processes of ``cgroup`` (a cgroup v2 directory) may allocate."""
        ...

    def get_limit(self, gpu: int, cgroup: str) -> CgroupMemoryLimit: ...

    def clear_limit(self, gpu: int, cgroup: str) -> None:
        """Remove the limits (NVML: soft 0, hard ``NVML_DEVICE_MEMORY_LIMIT_MAX``)."""
        ...


class Accounts(Protocol):
    """The host's users and groups, as the API's access rules need them (names in the
    configuration, memberships of a peer). The real one reads the passwd and group
    databases (:class:`migd.backends.accounts.SystemAccounts`); tests pass a fake, so no
    test depends on which accounts the host has."""

    def user_name(self, uid: int) -> str | None:
        """The login name of ``uid``, or None when the host has no such user."""
        ...

    def group_ids(self, uid: int, gid: int) -> frozenset[int]:
        """Every group ``uid`` (primary group ``gid``) is in; at least ``gid``."""
        ...

    def group_id(self, name: str) -> int | None:
        """The gid of the group called ``name``, or None when there is none."""
        ...

    def user_id(self, name: str) -> int | None:
        """The uid of the user called ``name``, or None when there is none
        (``migd --check-config`` checks the names in ``[api]``)."""
        ...

    def forget(self) -> None:
        """Drop cached answers (on SIGHUP: an admin who added a user to a group, then
        reloaded, expects it to count)."""
        ...


class StartdControl(Protocol):
    """HTCondor's startd on this node, told which GPUs it must not hand out.

    Implemented by :class:`migd.backends.condor.StartdOffline` (a config file the shipped
    HTCondor configuration includes, then ``condor_reconfig``); see
    :mod:`migd.core.condor_shares` for what the startd does with it.
    """

    def set_offline_gpus(self, uuids: Sequence[str]) -> list[str]:
        """Make the shares of these physical GPUs (all others: online) offline in the
        startd; returns the share IDs written. Blocking (runs HTCondor's tools).

        Raises:
            StartdError: the file could not be written or the startd not reconfigured.
        """
        ...


class StartdConfig(Protocol):
    """The startd's effective HTCondor configuration on this node, read-only.

    Implemented by :class:`migd.backends.condor.CondorConfigVal` (``condor_config_val
    -subsystem startd``); :mod:`migd.core.startd_settings` checks what it reads.
    """

    def value(self, name: str) -> str | None:
        """The knob's value as the startd would use it (macros expanded), None when it
        is not defined. Blocking (runs HTCondor's tool).

        Raises:
            StartdError: the tool could not be run or failed for another reason.
        """
        ...


class Clock(Protocol):
    def now(self) -> float:
        """Wall-clock seconds since the epoch (for records)."""
        ...

    def monotonic(self) -> float:
        """Monotonic seconds (for deadlines and intervals)."""
        ...


@dataclass
class SystemClock:
    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


@dataclass
class ManualClock:
    """A clock tests and the simulator move by hand."""

    t: float = 1_700_000_000.0
    mono: float = 0.0

    def now(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.t += seconds
        self.mono += seconds

    def step_wall(self, seconds: float) -> None:
        """The wall clock is set (an NTP step, an admin's ``date``; backwards when
        negative): wall time jumps, monotonic time does not."""
        self.t += seconds
