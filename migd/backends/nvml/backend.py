"""The NVML GPU backend: the boundary class, the only object in migd that talks to ``pynvml``.

:class:`NvmlBackend` implements :class:`migd.ports.GpuBackend` over a
``pynvml``-compatible module: the real ``pynvml`` (``nvidia-ml-py``, imported
lazily) or the simulated stand-in
(:class:`migd.backends.simulated.fake_pynvml.FakePynvml`). The same code runs
against both; it relies only on pynvml's documented calling conventions
(verified against ``pynvml.py`` of nvidia-ml-py 13.615.71):

* MIG handles and structures are ctypes objects; ``char[]`` fields may read as
  ``str`` or ``bytes`` (both handled);
* the placement given to ``nvmlDeviceCreateGpuInstanceWithPlacement`` is passed
  with ``ctypes.byref``: pynvml forwards it unchanged to a C function that takes
  a pointer (no ``argtypes``), and a by-value structure crashes the process;
* list calls fill a caller-allocated ctypes array and write the count through
  ``ctypes.byref(c_uint)``; arrays are sized from the profile's instance count.

MIG device UUIDs are found through the parent's MIG device handles
(``nvmlDeviceGetMaxMigDeviceCount`` + ``nvmlDeviceGetMigDeviceHandleByIndex``,
NOT_FOUND being an empty slot), matched by ``nvmlDeviceGetGpuInstanceId`` /
``nvmlDeviceGetComputeInstanceId``. ``nvmlComputeInstanceInfo_t.device`` is
documented in ``nvml.h`` as the *parent* device, so its UUID is the GPU's; it is
used only after ``nvmlDeviceIsMigDeviceHandle`` and the ids confirm that a driver
put the MIG device there (:mod:`~migd.backends.nvml.mig_devices`).

This class holds the session, the caches and the order of the calls; the calls
themselves are in the package's modules (:mod:`migd.backends.nvml` lists them).

Every NVML error is translated once, into :mod:`migd.errors`, by
:func:`~migd.backends.nvml.errors.nvml_errors`. Reads that only add detail degrade to
``None``/empty and log once; reads the daemon decides on (instances, processes) and all
writes raise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from migd.backends.holders import Holder, describe_holders, device_file_holders
from migd.backends.nvml.discovery import (
    degradable,
    read_driver_versions,
    read_gpu,
    read_mig_mode,
)
from migd.backends.nvml.errors import (
    MigModeReader,
    nvml_errors,
    versioned_info,
)
from migd.backends.nvml.geometry import builtin_geometry, from_nvml_or_table
from migd.backends.nvml.mig import (
    MIG_HANDLE_RETRIES,
    CiProfile,
    ci_index_for,
    create_gpu_instance,
    explain_refusal,
    list_compute_instances,
    list_gpu_instances,
    read_ci_profiles,
    read_possible_placements,
    read_profile_infos,
    roll_back,
)
from migd.backends.nvml.mig_devices import MigDevice, MigDevices, MigIds, confirmed_mig_device
from migd.backends.nvml.processes import (
    MIB,
    instance_ids,
    list_raw_processes,
    merge_processes,
    read_memory,
)
from migd.core.geometry import Geometry, NvmlProfileInfo, Profile
from migd.errors import (
    DriverUnavailable,
    GpuBusy,
    GpuError,
    GpuNotFound,
    GpuUnsupported,
    InstanceNotFound,
    InsufficientResources,
    MigdError,
    MigModeError,
)
from migd.ports import ComputeInstance, GpuInfo, GpuProcess, MemoryInfo, MigInstance

# The package's name, as before the split: log filters and docs name this logger.
_log = logging.getLogger("migd.backends.nvml")

# -- the backend ------------------------------------------------------------------------------


class NvmlBackend:
    """:class:`migd.ports.GpuBackend` over NVML (``pynvml`` or the simulated stand-in).

    Args:
        nvml: a ``pynvml``-compatible module or object; ``None`` imports ``pynvml``
            on first use.
        destroy_retries: further attempts after a destroy meets NVML "in use".
        retry_backoff_s: wait before the first retry; doubles each time.
        sleep: how to wait between retries (tests pass a recorder).

    Raises:
        DriverUnavailable: (on first use) no bindings, no library or no driver.
    """

    def __init__(
        self,
        nvml: ModuleType | object | None = None,
        *,
        destroy_retries: int = 3,
        retry_backoff_s: float = 0.2,
        sleep: Callable[[float], None] = time.sleep,
        holders: Callable[[], list[Holder]] = device_file_holders,
    ) -> None:
        self._given: Any = nvml
        self._holders = holders  # who has /dev/nvidia* open: named when a destroy is refused
        self._nvml: Any = None
        self._initialized = False
        self._destroy_retries = max(0, destroy_retries)
        self._retry_backoff_s = retry_backoff_s
        self._sleep = sleep
        self._init_lock = threading.Lock()
        self._reset_caches()

    def _reset_caches(self) -> None:
        self._handles: dict[int, Any] = {}
        self._infos: dict[int, GpuInfo] = {}
        self._versions: tuple[str, str] | None = None
        self._geometries: dict[int, Geometry] = {}
        self._ci_profile_cache: dict[tuple[int, int], list[CiProfile]] = {}
        # The MIG devices last seen per GPU, by (GI id, CI id).
        self._mig = MigDevices(self._n, self._handle)
        self._logged: set[str] = set()

    # -- session ----------------------------------------------------------------------------

    @property
    def nvml(self) -> Any:
        """The initialised pynvml module in use."""
        return self._n()

    def _n(self) -> Any:
        if self._initialized:
            return self._nvml
        with self._init_lock:
            if self._nvml is None:
                self._nvml = self._given if self._given is not None else _import_pynvml()
            if not self._initialized:
                nvml = self._nvml
                with nvml_errors("initialise NVML"):
                    flag = getattr(nvml, "NVML_INIT_FLAG_NO_GPUS", None)
                    if flag is not None and hasattr(nvml, "nvmlInitWithFlags"):
                        # Succeeds on a node without GPUs, so discovery can say "none".
                        nvml.nvmlInitWithFlags(flag)
                    else:
                        nvml.nvmlInit()
                self._initialized = True
        return self._nvml

    def close(self) -> None:
        """End the NVML session (``nvmlShutdown``); a later call starts a new one."""
        with self._init_lock:
            if self._initialized:
                try:
                    self._nvml.nvmlShutdown()
                except Exception as exc:  # shutting down: nothing left to protect
                    _log.warning("nvmlShutdown failed: %s", exc)
                self._initialized = False
            self._reset_caches()

    def __enter__(self) -> NvmlBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _log_once(self, key: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
        if key not in self._logged:
            self._logged.add(key)
            _log.log(level, message, *args)

    def _handle(self, gpu: int) -> Any:
        handle = self._handles.get(gpu)
        if handle is None:
            nvml = self._n()
            if gpu < 0:
                raise GpuNotFound(f"there is no GPU {gpu}", gpu=gpu)
            with nvml_errors("open GPU", gpu=gpu, invalid_argument=GpuNotFound):
                handle = nvml.nvmlDeviceGetHandleByIndex(gpu)
            self._handles[gpu] = handle
        return handle

    # -- discovery ----------------------------------------------------------------------------

    def discover(self) -> list[GpuInfo]:
        """All GPUs in NVML index order (``nvidia-smi -L``, ``nvidia-smi -q``).

        A GPU that has fallen off the bus is left out (and logged); the others keep
        their NVML index.

        Raises:
            DriverUnavailable: no NVML library, no driver, or NVML not initialisable.
        """
        nvml = self._n()
        with nvml_errors("count GPUs"):
            count = int(nvml.nvmlDeviceGetCount())
        found: list[GpuInfo] = []
        for index in range(count):
            try:
                found.append(self._read_gpu(index))
            except GpuNotFound as err:
                _log.error("GPU %d left out of discovery: %s", index, err)
        return found

    def _read_gpu(self, gpu: int) -> GpuInfo:
        nvml = self._n()
        handle = self._handle(gpu)
        info = read_gpu(nvml, handle, gpu, self._driver_versions(), self._log_once)
        self._infos[gpu] = info
        return info

    def _info(self, gpu: int) -> GpuInfo:
        return self._infos.get(gpu) or self._read_gpu(gpu)

    def _driver_versions(self) -> tuple[str, str]:
        if self._versions is None:
            self._versions = read_driver_versions(self._n(), self._log_once)
        return self._versions

    def _mig_mode(self, gpu: int) -> tuple[bool | None, bool | None]:
        """(current, pending) MIG mode; (None, None) where the GPU has no MIG.

        Raises:
            GpuError: NVML could not read the mode (e.g. NVML_ERROR_UNKNOWN). That is not
                "no MIG": a MIG GPU managed as a whole GPU would be handed out wrongly.
        """
        return read_mig_mode(self._n(), self._handle(gpu), gpu, self._log_once)

    def _mig_mode_reader(self, gpu: int) -> MigModeReader:
        return lambda: self._mig_mode(gpu)

    # -- geometry -----------------------------------------------------------------------------

    def geometry(self, gpu: int) -> Geometry:
        """The GPU's MIG geometry from NVML (``nvidia-smi mig -lgip`` / ``-lgipp``).

        Profile infos and possible placements come from NVML; values NVML cannot give
        (driver default order, shared caps) from the built-in table of the detected
        model. The built-in table alone is used where NVML cannot say: placements need
        root, or MIG is disabled (then nothing is cached, so enabling MIG later is seen).

        Raises:
            GpuUnsupported: the GPU has no MIG, or NVML reports no usable profiles.
            MigModeError: MIG is disabled and the model is not in the built-in tables.
            GpuPermissionDenied: not root and the model is not in the built-in tables.
        """
        cached = self._geometries.get(gpu)
        if cached is not None:
            return cached
        info = self._info(gpu)
        current, _pending = self._mig_mode(gpu)
        if current is None:
            raise GpuUnsupported(
                f"GPU {gpu} ({info.name}) does not support MIG",
                hint="use the GPU whole (MPS only), or leave it out of migd.toml",
                gpu=gpu,
            )
        builtin = builtin_geometry(info)
        if not current:
            if builtin is None:
                raise MigModeError(
                    f"MIG is disabled on GPU {gpu} ({info.name}) and migd has "
                    "no built-in table for it",
                    gpu=gpu,
                )
            self._log_once(
                f"geo-disabled:{gpu}",
                "MIG is disabled on GPU %d; using the built-in %s table",
                gpu,
                builtin.model,
                level=logging.INFO,
            )
            return builtin
        geometry = from_nvml_or_table(
            gpu,
            info,
            builtin,
            lambda: self.profile_infos_with_engines(gpu),
            lambda profile_id: self.possible_placements(gpu, profile_id),
            self._log_once,
        )
        self._geometries[gpu] = geometry
        return geometry

    def profile_infos(self, gpu: int) -> list[NvmlProfileInfo]:
        """What NVML says about every GPU instance profile of this GPU (``-lgip``).

        Raises:
            MigModeError: MIG is disabled. GpuPermissionDenied: NVML refuses the read.
        """
        return [info for info, _engines in self.profile_infos_with_engines(gpu)]

    def profile_infos_with_engines(self, gpu: int) -> list[tuple[NvmlProfileInfo, dict[str, int]]]:
        """:meth:`profile_infos` plus each profile's engine counts (``ce``, ``dec``, ...)."""
        return read_profile_infos(self._n(), self._handle(gpu), gpu, self._mig_mode_reader(gpu))

    def possible_placements(self, gpu: int, profile_id: int) -> list[tuple[int, int]]:
        """``(start, size)`` of every placement of a profile, free or not (``-lgipp``).

        Raises:
            GpuPermissionDenied: NVML requires root for this query.
        """
        return read_possible_placements(
            self._n(), self._handle(gpu), gpu, profile_id, self._mig_mode_reader(gpu)
        )

    # -- instances ----------------------------------------------------------------------------

    def list_instances(self, gpu: int) -> list[MigInstance]:
        """GPU instances with all their compute instances and MIG UUIDs (``nvidia-smi mig -lgi``).

        Empty when MIG is disabled. The MIG devices are walked once per listing.

        Raises:
            GpuUnsupported: no MIG on this GPU.
            GpuPermissionDenied: not root (NVML lists instances for root only).
            GpuError: the MIG mode cannot be read, or a compute instance has no MIG
                device even after a second look (NVML contradicts itself).
        """
        current, _pending = self._mig_mode(gpu)
        if current is False:
            self._mig.remember(gpu, {})
            return []
        geometry = self.geometry(gpu)
        nvml = self._n()
        handle = self._handle(gpu)
        raw: list[tuple[Any, Profile, Any, list[tuple[int, int]]]] = []
        for profile in geometry.profiles:
            for gi in list_gpu_instances(
                nvml, handle, gpu, profile, geometry.units, self._mig_mode_reader(gpu)
            ):
                with nvml_errors("read GPU instance", gpu=gpu):
                    info = nvml.nvmlGpuInstanceGetInfo(gi)
                cis = [
                    (ci_id, slices)
                    for _ci, ci_id, slices in self._gi_compute_instances(
                        gpu, gi, int(info.profileId)
                    )
                ]
                raw.append((gi, profile, info, cis))
        wanted = {(int(info.id), ci_id) for _gi, _p, info, cis in raw for ci_id, _s in cis}
        devices: dict[MigIds, MigDevice] = {}
        for ids in wanted:
            cached = self._mig.cached(gpu, ids)
            if cached is None:
                devices = self._mig.walk(gpu)  # one walk finds them all
                if wanted - devices.keys():  # made while we looked: one more look
                    devices = self._mig.walk(gpu)
                break
            devices[ids] = cached
        self._mig.remember(gpu, {ids: devices[ids] for ids in wanted if ids in devices})
        missing = sorted(wanted - devices.keys())
        if missing:
            raise GpuError(
                f"GPU {gpu}: compute instance(s) {missing} (GPU instance id, compute instance "
                "id) have no MIG device in NVML's MIG device list",
                hint="`nvidia-smi -L` and `nvidia-smi mig -lci` should agree; if they do not, "
                "reset the GPU",
                gpu=gpu,
                missing=missing,
            )
        found = [
            self._describe_gi(gpu, profile, info, cis, devices) for _gi, profile, info, cis in raw
        ]
        found.sort(key=lambda m: (m.start, m.gi_id))
        return found

    def _describe_gi(
        self,
        gpu: int,
        profile: Profile,
        info: Any,
        cis: list[tuple[int, int]],
        devices: dict[MigIds, MigDevice],
    ) -> MigInstance:
        gi_id = int(info.id)
        computes = tuple(
            ComputeInstance(ci_id=ci_id, uuid=devices[(gi_id, ci_id)][0], slices=slices)
            for ci_id, slices in sorted(cis)
        )
        first = devices.get((gi_id, computes[0].ci_id)) if computes else None
        return MigInstance(
            gpu=gpu,
            gi_id=gi_id,
            profile_id=int(info.profileId),
            start=int(info.placement.start),
            size=int(info.placement.size),
            memory_total_mib=self._mig_memory_total(
                gpu, None if first is None else first[1], profile
            ),
            compute_instances=computes,
        )

    def _ci_profiles(self, gpu: int, gi: Any, gi_profile_id: int) -> list[CiProfile]:
        """Compute instance profiles a GI of this profile supports, largest first (cached)."""
        key = (gpu, gi_profile_id)
        cached = self._ci_profile_cache.get(key)
        if cached is not None:
            return cached
        found = read_ci_profiles(self._n(), gpu, gi)
        self._ci_profile_cache[key] = found
        return found

    def _gi_compute_instances(
        self, gpu: int, gi: Any, gi_profile_id: int
    ) -> list[tuple[Any, int, int]]:
        """Every compute instance of a GPU instance: (handle, CI id, compute slices)."""
        nvml = self._n()
        out: list[tuple[Any, int, int]] = []
        for ci_profile in self._ci_profiles(gpu, gi, gi_profile_id):
            for ci in list_compute_instances(nvml, gpu, gi, ci_profile):
                with nvml_errors("read compute instance", gpu=gpu):
                    ci_id = int(nvml.nvmlComputeInstanceGetInfo(ci).id)
                out.append((ci, ci_id, ci_profile.slices))
        return out

    def create_instance(self, gpu: int, profile_id: int, start: int) -> MigInstance:
        """Create a GPU instance at ``start`` plus its full compute instance.

        Same as ``nvidia-smi mig -cgi <profile_id>:<start> -C -i <gpu>``.

        Raises:
            UnknownProfile: the GPU has no such profile.
            InvalidStart: ``start`` is not a placement of the profile.
            InsufficientResources: slices taken, or a per-profile/shared limit reached
                (the message says which, from migd's state machine).
            GpuPermissionDenied: not root. MigModeError: MIG disabled or pending.
            GpuBusy, GpuNotFound: see :mod:`migd.errors`.
        """
        geometry = self.geometry(gpu)
        profile = geometry.by_id(profile_id)
        try:
            gi = create_gpu_instance(
                self._n(), self._handle(gpu), gpu, profile, start, self._mig_mode_reader(gpu)
            )
        except InsufficientResources as err:
            # Chain to NVML's error itself: the message is refined, not translated twice.
            raise explain_refusal(
                gpu, geometry, profile, start, err, lambda: self.list_instances(gpu)
            ) from err.__cause__
        return self._finish_create(gpu, gi, profile)

    def _finish_create(self, gpu: int, gi: Any, profile: Profile) -> MigInstance:
        nvml = self._n()
        ci: Any = None
        try:
            with nvml_errors("read new GPU instance", gpu=gpu):
                gi_info = nvml.nvmlGpuInstanceGetInfo(gi)
            ci_index = ci_index_for(nvml, profile.compute_slices)
            with nvml_errors(
                f"create the compute instance of {profile.name}", gpu=gpu, profile=profile.name
            ):
                ci_profile = versioned_info(
                    nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo,
                    gi,
                    ci_index,
                    nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                )
                ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, int(ci_profile.id))
            with nvml_errors("read new compute instance", gpu=gpu):
                ci_info = nvml.nvmlComputeInstanceGetInfo(ci)
            ids = (int(gi_info.id), int(ci_info.id))
            uuid = self._new_mig_uuid(gpu, ids, ci_info.device)
        except BaseException:
            roll_back(nvml, gpu, gi, ci)
            raise
        cached = self._mig.cached(gpu, ids)
        return MigInstance(
            gpu=gpu,
            gi_id=ids[0],
            profile_id=profile.profile_id,
            start=int(gi_info.placement.start),
            size=int(gi_info.placement.size),
            memory_total_mib=self._mig_memory_total(
                gpu, None if cached is None else cached[1], profile
            ),
            compute_instances=(
                ComputeInstance(ci_id=ids[1], uuid=uuid, slices=profile.compute_slices),
            ),
        )

    def _mig_memory_total(self, gpu: int, handle: Any, profile: Profile) -> int:
        """What NVML reports as the MIG device's memory total, else the profile's size.

        The instance's real capacity is what a CUDA job on it sees; the profile's
        ``memorySizeMB`` is nominal, and an MPS pool on the instance must not promise
        more than the device has (issue 13, defect 7). A read NVML refuses falls back.
        """
        if handle is None:
            return profile.memory_mib
        nvml = self._n()
        total = degradable(
            self._log_once,
            "read MIG device memory",
            gpu,
            lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
        )
        return profile.memory_mib if not total else total // MIB

    def _new_mig_uuid(self, gpu: int, ids: MigIds, ci_device: Any) -> str:
        """The MIG UUID of a compute instance just made (GI id, CI id ``ids``).

        ``ci_device`` is ``nvmlComputeInstanceInfo_t.device``: nvml.h documents it as the
        parent GPU, whose UUID is the GPU's. It is used only where NVML confirms it is
        this MIG device (some drivers fill it in so); otherwise the MIG devices are walked.
        """
        confirmed = confirmed_mig_device(self._n(), ids, ci_device)
        if confirmed is not None:
            self._mig.add(gpu, ids, confirmed)
            return confirmed[0]
        found = self._mig.find(gpu, ids)
        # A new MIG device's handle can appear a moment after the creation returned
        # (docs/nvml.md): look again, with the destroy retries' back-off, before giving up.
        for attempt in range(MIG_HANDLE_RETRIES):
            if found is not None:
                break
            self._sleep(self._retry_backoff_s * (2**attempt))
            found = self._mig.walk(gpu).get(ids)
        if found is None:
            raise GpuError(
                f"GPU {gpu}: the new compute instance {ids[1]} of GPU instance {ids[0]} has "
                "no MIG device in NVML's MIG device list",
                hint="`nvidia-smi -L` should list it; if not, reset the GPU",
                gpu=gpu,
                gi_id=ids[0],
                ci_id=ids[1],
            )
        return found[0]

    def destroy_instance(self, gpu: int, gi_id: int) -> None:
        """Destroy the compute instance(s), then the GPU instance (``nvidia-smi mig -dci/-dgi``).

        Every compute instance's MIG device is checked for processes before any is
        destroyed: NVML refuses a busy compute instance only once the idle ones before
        it are gone, which would leave an in-use instance half destroyed. Processes and
        NVML "in use" are retried ``destroy_retries`` times with doubling back-off (a
        process that just ended may still be listed for a moment).

        Raises:
            InstanceNotFound: no GPU instance ``gi_id`` on this GPU.
            GpuBusy: still in use after the retries (processes on any of its compute
                instances, or another NVML client such as DCGM holding handles).
            GpuPermissionDenied: not root.
        """
        attempts = self._destroy_retries + 1
        last: GpuBusy | None = None
        for attempt in range(attempts):
            try:
                self._destroy_once(gpu, gi_id)
            except GpuBusy as err:
                last = err
                if attempt + 1 < attempts:
                    self._sleep(self._retry_backoff_s * (2**attempt))
                continue
            self._mig.forget_gpu_instance(gpu, gi_id)
            return
        pids = self._pids_on_gi(gpu, gi_id)
        # No process listed: another NVML client holds the instance (DCGM#276); say who
        # the host shows holding the device files, so migctl status names the cause.
        holders = "" if pids else describe_holders(self._holders())
        raise GpuBusy(
            f"GPU instance {gi_id} on GPU {gpu} is still in use after {attempts} attempts"
            + (f" (processes {', '.join(map(str, pids))})" if pids else f"; {holders}"),
            gpu=gpu,
            gi_id=gi_id,
            attempts=attempts,
            pids=pids,
            holders=holders,
        ) from last

    def _destroy_once(self, gpu: int, gi_id: int) -> None:
        nvml = self._n()
        handle = self._handle(gpu)
        try:
            with nvml_errors(
                f"find GPU instance {gi_id}",
                gpu=gpu,
                gi_id=gi_id,
                not_found=InstanceNotFound,
                invalid_argument=InstanceNotFound,
                mig_mode=self._mig_mode_reader(gpu),
            ):
                gi = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
                gi_profile_id = int(nvml.nvmlGpuInstanceGetInfo(gi).profileId)
        except InstanceNotFound as err:
            raise InstanceNotFound(
                f"GPU {gpu} has no GPU instance {gi_id} ({err.message})",
                hint="`migctl status` (or `nvidia-smi mig -lgi`) lists the instances",
                **err.details,
            ) from err
        cis = self._gi_compute_instances(gpu, gi, gi_profile_id)
        if cis:
            pids = self._pids_on_gi(gpu, gi_id, [ci_id for _ci, ci_id, _s in cis], strict=True)
            if pids:
                raise GpuBusy(
                    f"GPU instance {gi_id} on GPU {gpu} has processes "
                    f"{', '.join(map(str, pids))} on its compute instances; none destroyed",
                    gpu=gpu,
                    gi_id=gi_id,
                    pids=pids,
                )
        for ci, ci_id, _slices in cis:
            with nvml_errors(
                f"destroy compute instance {ci_id} of GPU instance {gi_id}", gpu=gpu, gi_id=gi_id
            ):
                nvml.nvmlComputeInstanceDestroy(ci)
        with nvml_errors(f"destroy GPU instance {gi_id}", gpu=gpu, gi_id=gi_id):
            nvml.nvmlGpuInstanceDestroy(gi)

    def _pids_on_gi(
        self, gpu: int, gi_id: int, ci_ids: list[int] | None = None, *, strict: bool = False
    ) -> list[int]:
        """PIDs on the MIG devices of GPU instance ``gi_id`` (compute instances ``ci_ids``,
        or every one NVML lists).

        ``strict``: NVML errors raise (a destroy must not go ahead on a guess); otherwise
        what could be read is returned (for messages).
        """
        pids: set[int] = set()
        try:
            if ci_ids is None:
                devices = [found for (g, _c), found in self._mig.walk(gpu).items() if g == gi_id]
            else:
                devices = []
                for ci_id in ci_ids:
                    found = self._mig.find(gpu, (gi_id, ci_id))
                    if found is None:
                        raise GpuError(
                            f"compute instance {ci_id} of GPU instance {gi_id} on GPU {gpu} "
                            "has no MIG device, so its processes cannot be checked",
                            hint="`nvidia-smi -L` should list it; if not, reset the GPU",
                            gpu=gpu,
                            gi_id=gi_id,
                            ci_id=ci_id,
                        )
                    devices.append(found)
            for uuid, device in devices:
                pids.update(p.pid for p in self._device_processes(gpu, device, uuid))
        except MigdError:
            if strict:
                raise
        return sorted(pids)

    # -- memory, processes -------------------------------------------------------------------

    def memory(self, gpu: int, mig_uuid: str | None = None) -> MemoryInfo:
        """Memory of the GPU or of one MIG device (``nvidia-smi --query-gpu=memory.*``).

        Raises:
            GpuNotFound: no such GPU or MIG device.
        """
        handle = self._mig.handle_of(gpu, mig_uuid) if mig_uuid else self._handle(gpu)
        return read_memory(self._n(), handle, gpu, mig_uuid)

    def processes(self, gpu: int, mig_uuid: str | None = None) -> list[GpuProcess]:
        """CUDA processes (and MPS clients) on the GPU or one MIG device, by pid.

        Same as the process table of ``nvidia-smi``. On a MIG GPU the whole-GPU query
        needs root (NVML aggregates across instances for privileged callers only).

        Raises:
            GpuPermissionDenied: whole-GPU query in MIG mode without root.
            GpuNotFound: no such GPU or MIG device.
        """
        handle = self._mig.handle_of(gpu, mig_uuid) if mig_uuid else self._handle(gpu)
        return self._device_processes(gpu, handle, mig_uuid)

    def _device_processes(self, gpu: int, handle: Any, mig_uuid: str | None) -> list[GpuProcess]:
        """Compute and MPS client processes on one device handle (a GPU or a MIG device)."""
        raw = list_raw_processes(
            self._n(),
            gpu,
            handle,
            mig_uuid,
            lambda err: self._log_once(
                f"mps-list:{gpu}", "%s; MPS clients not listed", err, level=logging.INFO
            ),
        )
        uuid_of = {} if mig_uuid else self._uuids_by_ids(gpu, [proc for proc, _mps in raw])
        return merge_processes(gpu, raw, mig_uuid, uuid_of)

    def _uuids_by_ids(self, gpu: int, raw: list[Any]) -> dict[tuple[int, int], str]:
        """(GI id, CI id) -> MIG UUID for the processes' instances; one refresh if unknown."""
        wanted = {ids for ids in map(instance_ids, raw) if ids is not None}
        known = self._mig.known(gpu)
        if wanted - known.keys():
            try:
                known = self._mig.walk(gpu)
            except MigdError as err:  # the UUIDs are detail; the processes are still right
                self._log_once(f"uuids:{gpu}", "%s; MIG UUIDs of processes unknown", err)
        return {ids: uuid for ids, (uuid, _device) in known.items()}

    def heartbeat(self, gpu: int) -> None:
        """One cheap NVML call on the GPU; raises if the driver or the GPU stopped answering.

        Raises:
            GpuNotFound: the GPU fell off the bus. DriverUnavailable: the driver is gone.
        """
        nvml = self._n()
        with nvml_errors("heartbeat", gpu=gpu):
            nvml.nvmlDeviceGetMemoryInfo(self._handle(gpu))


def _import_pynvml() -> ModuleType:
    try:
        import pynvml
    except ImportError as exc:
        raise DriverUnavailable(
            "the NVML Python bindings (nvidia-ml-py) are not installed",
            hint="install nvidia-ml-py in migd's environment",
        ) from exc
    module: ModuleType = pynvml
    return module


__all__ = ["NvmlBackend"]
