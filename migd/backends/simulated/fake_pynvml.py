"""A stand-in for the ``pynvml`` module, backed by a :class:`SimNode`.

``FakePynvml(node)`` has the pynvml functions :class:`~migd.backends.nvml.NvmlBackend`
calls, with pynvml's parameter names and argument conventions, plus the constants,
ctypes types and ``NVMLError`` classes (same ``value`` codes). Handles are real
ctypes pointers of pynvml's handle types (an opaque token as the address, never
dereferenced), caller-allocated arrays are filled in place and counts are written
through ``ctypes.byref``.

Where real NVML would crash or corrupt memory instead of returning an error, this
stand-in raises ``TypeError``/``ValueError`` that names the mistake:

* a structure passed by value where NVML takes a pointer
  (``nvmlDeviceCreateGpuInstanceWithPlacement``: pynvml sets no ``argtypes`` and
  forwards the argument as is; reference §5.2 shows by-value segfaulting);
* a count passed by value instead of ``byref``;
* a caller array shorter than what NVML writes into it, or of another element type.

Where ctypes itself refuses an argument (pynvml sets no ``argtypes``, so ctypes
converts only ints, ``None``, bytes and ctypes objects), this stand-in raises the
same ``ctypes.ArgumentError``: a Python list as a caller array, a float as a
profile id. A NULL array where NVML does not document NULL as a size query
(``nvmlDeviceGetGpuInstances``, ``nvmlGpuInstanceGetComputeInstances``) is
NVML's INVALID_ARGUMENT, as in ``nvml.h``.

``nvmlComputeInstanceInfo_t.device`` is the *parent* GPU's handle, as ``nvml.h``
documents the field ("Parent device"); a MIG device's handle comes from
``nvmlDeviceGetMigDeviceHandleByIndex``. ``FakePynvml(node, ci_info_device="mig")``
models a driver that fills in the MIG device's handle there instead, so code can be
tested against both readings.

Error codes follow ``nvml.h`` (NVIDIA/go-nvml ``2f9e261``, ``gen/nvml/nvml.h``),
cited where the node raises them (:mod:`migd.backends.simulated.node`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any, Literal

from migd.backends.simulated import nvml_api as api
from migd.backends.simulated.mig_ops import CI_PROFILE_1_SLICE_REV1, REV1_REPORTED_ID
from migd.backends.simulated.node import MIB, SimNode
from migd.backends.simulated.specs import COMPUTE_MODES
from migd.backends.simulated.state import SimComputeInstance, SimGpu, SimGpuInstance, SimProcess
from migd.core.geometry import Profile

# pynvml functions that nvml.h marks "Requires privileged user" / root.
PRIVILEGED_CALLS = frozenset(
    {
        "nvmlDeviceGetGpuInstancePossiblePlacements",
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlDeviceGetGpuInstances",
        "nvmlDeviceGetGpuInstanceById",
        "nvmlGpuInstanceDestroy",
        "nvmlGpuInstanceCreateComputeInstance",
        "nvmlGpuInstanceGetComputeInstances",
        "nvmlGpuInstanceGetComputeInstanceById",
        "nvmlComputeInstanceDestroy",
    }
)

# Calls that change the GPU (a read-only client, e.g. scripts/gpu_probe.py, makes none).
WRITE_CALLS = frozenset(
    {
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlGpuInstanceDestroy",
        "nvmlGpuInstanceCreateComputeInstance",
        "nvmlComputeInstanceDestroy",
    }
)

_CArgObject: type = type(ctypes.byref(ctypes.c_uint()))


def _deref(ref: Any, what: str, call: str) -> Any:
    """The object behind ``byref(x)`` or ``pointer(x)``; TypeError for anything passed by value."""
    if isinstance(ref, _CArgObject):
        return ref._obj  # type: ignore[attr-defined]
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    raise TypeError(
        f"{call}: {what} must be passed by reference (ctypes.byref(...)), got "
        f"{type(ref).__name__}. NVML takes a pointer here and pynvml forwards the argument "
        "unchanged (no argtypes), so a by-value argument makes real NVML read garbage or "
        "segfault"
    )


def _not_convertible(position: int) -> ctypes.ArgumentError:
    # What ctypes raises for an argument of a foreign function without ``argtypes`` that it
    # cannot convert (a float, a list, ...).
    return ctypes.ArgumentError(
        f"argument {position}: TypeError: Don't know how to convert parameter {position}"
    )


def _c_uint(position: int, value: Any) -> int:
    """An integer argument pynvml hands to NVML unconverted: what ctypes would accept."""
    if isinstance(value, int):
        return value
    if isinstance(value, ctypes._SimpleCData) and isinstance(value.value, int):
        return int(value.value)
    raise _not_convertible(position)


def _c_array(call: str, position: int, value: Any, element: Any) -> Any:
    """A caller-allocated ctypes array (or a reference to one) of ``element``."""
    if isinstance(value, _CArgObject):
        value = value._obj  # type: ignore[attr-defined]
    elif isinstance(value, ctypes._Pointer):
        value = value.contents
    if not isinstance(value, ctypes.Array):
        if isinstance(value, ctypes._SimpleCData | ctypes.Structure | ctypes.Union):
            raise TypeError(
                f"{call}: argument {position} must be an array of {element.__name__}, got "
                f"{type(value).__name__}: NVML would write past it"
            )
        raise _not_convertible(position)
    if value._type_ is not element:
        raise TypeError(
            f"{call}: argument {position} is an array of {value._type_.__name__}, NVML writes "
            f"{element.__name__}: real NVML would corrupt memory"
        )
    return value


def _serialised(cls: type[FakePynvml]) -> type[FakePynvml]:
    """Run every ``nvml*`` read under the node lock, as one driver call.

    A call reads several pieces of node state (a GPU instance, then its compute
    instances, ...); holding the lock makes each call see one consistent node, as a
    real driver call does, whichever threads and clients call at the same time.
    Writes (:data:`WRITE_CALLS`) take the lock themselves, only around their reads and
    their commit: a simulated create latency must not stall every other NVML call.
    """

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def locked(self: FakePynvml, *args: Any, **kwargs: Any) -> Any:
            with self.node.lock:
                return function(self, *args, **kwargs)

        return locked

    for name, value in list(vars(cls).items()):
        if name.startswith("nvml") and callable(value) and name not in WRITE_CALLS:
            setattr(cls, name, wrap(value))
    return cls


@_serialised
class FakePynvml:
    """A ``pynvml``-compatible module object over a :class:`SimNode`. Thread-safe.

    Each instance is one NVML client with its own init count (``nvmlInit`` /
    ``nvmlShutdown``); several may share a node.
    """

    def __init__(
        self,
        node: SimNode,
        *,
        legacy_driver: bool = False,
        ci_info_device: Literal["parent", "mig"] = "parent",
    ) -> None:
        self.node = node
        # What nvmlComputeInstanceGetInfo puts in ``device``: the parent GPU (nvml.h), or
        # the MIG device (what some drivers are reported to do).
        self.ci_info_device = ci_info_device
        # True: a driver older than the newest versioned entry points pynvml prefers
        # (the _v3 process queries, the ...ProfileInfoV calls): pynvml then raises
        # NVMLLibraryMismatchError or NVMLError_FunctionNotFound.
        self.legacy_driver = legacy_driver
        self._init_count = 0
        self._next_token = 0x1000
        self._token_of: dict[tuple[Any, ...], int] = {}
        self._key_of: dict[int, tuple[Any, ...]] = {}
        # Constants, error classes and ctypes types, under pynvml's names.
        for name in dir(api):
            if name.startswith(
                ("NVML_", "NVMLError", "NVMLLibrary", "c_nvml", "struct_c_nvml", "nvml")
            ):
                setattr(self, name, getattr(api, name))

    def __getattr__(self, name: str) -> Any:
        # Only reached for names neither set above nor defined below.
        raise AttributeError(
            f"the simulated pynvml has no {name!r}; add it to FakePynvml if NvmlBackend "
            "starts calling it"
        )

    # -- plumbing ---------------------------------------------------------------------------

    def _enter(self, call: str, gpu: int | None = None) -> None:
        if self._init_count <= 0:
            # nvml.h: every call returns NVML_ERROR_UNINITIALIZED before nvmlInit.
            self.node.check_call(call, gpu)  # counts the call, honours injected faults
            raise api.NVMLError(api.NVML_ERROR_UNINITIALIZED)
        self.node.check_call(call, gpu, privileged=call in PRIVILEGED_CALLS)

    def _handle(self, pointer_type: Any, key: tuple[Any, ...]) -> Any:
        with self.node.lock:
            token = self._token_of.get(key)
            if token is None:
                self._next_token += 0x10
                token = self._next_token
                self._token_of[key] = token
                self._key_of[token] = key
        return ctypes.cast(ctypes.c_void_p(token), pointer_type)

    def _key(self, handle: Any, kinds: tuple[str, ...]) -> tuple[Any, ...]:
        token = api.pointer_token(handle)
        with self.node.lock:
            key = self._key_of.get(token) if token is not None else None
        if key is None or key[0] not in kinds:
            # nvml.h: NVML_ERROR_INVALID_ARGUMENT "if device is invalid".
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
        return key

    def _device(self, call: str, handle: Any) -> SimGpu:
        key = self._key(handle, ("gpu",))
        self._enter(call, key[1])
        return self.node.gpu(key[1])

    def _device_or_mig(
        self, call: str, handle: Any
    ) -> tuple[SimGpu, SimGpuInstance | None, SimComputeInstance | None]:
        key = self._key(handle, ("gpu", "mig"))
        self._enter(call, key[1])
        if key[0] == "gpu":
            return self.node.gpu(key[1]), None, None
        gpu, gi, ci = self.node.mig.lookup_ci(key[2])
        return gpu, gi, ci

    def _gi(self, call: str, handle: Any) -> tuple[SimGpu, SimGpuInstance]:
        key = self._key(handle, ("gi",))
        self._enter(call, key[1])
        with self.node.lock:
            return self.node.mig.lookup_gi(key[2])

    def _gi_handle(self, gpu: SimGpu, gi: SimGpuInstance) -> Any:
        return self._handle(api.c_nvmlGpuInstance_t, ("gi", gpu.index, gi.serial))

    def _ci_handle(self, gpu: SimGpu, ci: SimComputeInstance) -> Any:
        return self._handle(api.c_nvmlComputeInstance_t, ("ci", gpu.index, ci.serial))

    def _mig_handle(self, gpu: SimGpu, ci: SimComputeInstance) -> Any:
        return self._handle(api.c_nvmlDevice_t, ("mig", gpu.index, ci.serial))

    @staticmethod
    def _fill(
        call: str, array: Any, count_ref: Any, items: list[Any], *, null_counts: bool = False
    ) -> None:
        """Fill a caller-allocated array (already checked with :func:`_c_array`) and write
        the count, as NVML does.

        ``null_counts``: NULL asks for the count only (nvml.h says so for possible
        placements); elsewhere NULL is INVALID_ARGUMENT.
        """
        count = _deref(count_ref, "count", call)
        if array is None:
            if not null_counts:
                # nvml.h: INVALID_ARGUMENT "If ... gpuInstances / computeInstances ... are
                # invalid"; only the placement query documents NULL as a size query.
                raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
            count.value = len(items)
            return
        if len(array) < len(items):
            raise ValueError(
                f"{call}: the caller's array has {len(array)} entries but NVML writes "
                f"{len(items)}: real NVML would write past its end (size it from the "
                "profile's instance count)"
            )
        for i, item in enumerate(items):
            array[i] = item
        count.value = len(items)

    # -- init / system ------------------------------------------------------------------------

    def nvmlInitWithFlags(self, flags: int) -> None:
        self.node.check_call("nvmlInitWithFlags")
        self._init_count += 1

    def nvmlInit(self) -> None:
        self.node.check_call("nvmlInit")
        self._init_count += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self._init_count -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.node.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.node.cuda_version

    # -- devices ------------------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return self.node.gpu_count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if not isinstance(index, int):
            raise TypeError(f"'{type(index).__name__}' object cannot be interpreted as an integer")
        if not 0 <= index < self.node.gpu_count:
            self._enter("nvmlDeviceGetHandleByIndex")
            # nvml.h: INVALID_ARGUMENT "if index is invalid".
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
        self._enter("nvmlDeviceGetHandleByIndex", index)
        return self._handle(api.c_nvmlDevice_t, ("gpu", index))

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        gpu, _gi, ci = self._device_or_mig("nvmlDeviceGetUUID", handle)
        return ci.uuid if ci is not None else gpu.uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        gpu, gi, _ci = self._device_or_mig("nvmlDeviceGetName", handle)
        return gpu.spec.name if gi is None else f"{gpu.spec.name} MIG {gi.profile.name}"

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        gpu = self._device("nvmlDeviceGetPciInfo", handle)
        info = api.nvmlPciInfo_t()
        domain, bus, rest = gpu.pci_bus_id.split(":")
        info.busId = gpu.pci_bus_id
        info.busIdLegacy = gpu.pci_bus_id[4:]
        info.domain = int(domain, 16)
        info.bus = int(bus, 16)
        info.device = int(rest.split(".")[0], 16)
        info.pciDeviceId = gpu.spec.pci_device_id
        info.pciSubSystemId = 0
        return info

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        gpu, gi, _ci = self._device_or_mig("nvmlDeviceGetMemoryInfo", handle)
        if gi is None and gpu.mig_current and not self.node.is_root:
            # nvml.h (nvmlDeviceGetMemoryInfo): "In MIG mode, if device handle is provided,
            # the API returns aggregate information, only if the caller has appropriate
            # privileges. Per-instance information can be queried by using specific MIG
            # device handles."
            raise api.NVMLError(api.NVML_ERROR_NO_PERMISSION)
        gi_serial = gi.serial if gi is not None else None
        total, used = self.node.memory_mib(gpu.index, gi_serial)
        used += self.node.procs.reserved_mib(gpu.index, gi_serial)
        if not version:
            info: Any = api.c_nvmlMemory_t()
        else:
            info = api.c_nvmlMemory_v2_t()
            info.version = version
            info.reserved = 0
        info.total = total * MIB
        info.used = used * MIB
        info.free = (total - used) * MIB
        return info

    def nvmlDeviceGetPersistenceMode(self, handle: Any) -> int:
        # nvml.h: "For Linux only"; a MIG device handle is not a GPU (INVALID_ARGUMENT).
        gpu = self._device("nvmlDeviceGetPersistenceMode", handle)
        return api.NVML_FEATURE_ENABLED if gpu.spec.persistence_mode else api.NVML_FEATURE_DISABLED

    def nvmlDeviceGetComputeMode(self, handle: Any) -> int:
        gpu = self._device("nvmlDeviceGetComputeMode", handle)
        return COMPUTE_MODES[gpu.spec.compute_mode]

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        gpu, _gi, _ci = self._device_or_mig("nvmlDeviceGetCudaComputeCapability", handle)
        if gpu.spec.compute_capability is None:
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)
        return gpu.spec.compute_capability

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        gpu = self._device("nvmlDeviceGetMigMode", device)
        if gpu.mig_current is None:
            # nvml.h: NOT_SUPPORTED "If device doesn't support MIG mode".
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)
        return [int(gpu.mig_current), int(bool(gpu.mig_pending))]

    # -- GPU instance profiles and placements --------------------------------------------------

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: Any, profile: int, version: int = 2
    ) -> Any:
        profile = _c_uint(2, profile)
        gpu = self._device("nvmlDeviceGetGpuInstanceProfileInfo", device)
        if version not in (1, 2) or (version == 2 and self.legacy_driver):
            # pynvml: an unknown version, or a library without ...ProfileInfoV.
            raise api.NVMLError(api.NVML_ERROR_FUNCTION_NOT_FOUND)
        if not 0 <= profile < api.NVML_GPU_INSTANCE_PROFILE_COUNT:
            # nvml.h: "enumerate ... until the API returns NVML_ERROR_INVALID_ARGUMENT".
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
        geometry = self.node.mig.require_mig(gpu)
        found = next((p for p in geometry.profiles if p.nvml_index == profile), None)
        if found is None:
            # nvml.h: NOT_SUPPORTED "If ... profile isn't supported".
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)
        return self._profile_info(found, version)

    @staticmethod
    def _profile_info(found: Profile, version: int) -> Any:
        info: Any = (
            api.c_nvmlGpuInstanceProfileInfo_v2_t()
            if version == 2
            else api.c_nvmlGpuInstanceProfileInfo_t()
        )
        engines = dict(found.engines or {})
        info.id = found.profile_id
        info.isP2pSupported = 0
        info.sliceCount = found.compute_slices
        info.instanceCount = found.max_instances
        info.multiprocessorCount = found.sm_count or 0
        info.copyEngineCount = engines.get("ce", found.compute_slices)
        info.decoderCount = engines.get("dec", 0)
        info.encoderCount = engines.get("enc", 0)
        info.jpegCount = engines.get("jpeg", 0)
        info.ofaCount = engines.get("ofa", 0)
        info.memorySizeMB = found.memory_mib
        if version == 2:
            info.name = f"MIG {found.name}"
        return info

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: Any, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        call = "nvmlDeviceGetGpuInstancePossiblePlacements"
        profileId = _c_uint(2, profileId)
        if placementsRef is not None:  # ctypes converts (or refuses) before NVML runs
            placementsRef = _c_array(call, 3, placementsRef, api.c_nvmlGpuInstancePlacement_t)
        gpu = self._device(call, device)
        if gpu.geometry is None:
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)
        # nvml.h: "returns all the possible placements for the given profile regardless of
        # whether MIG is enabled or not".
        profile = next((p for p in gpu.geometry.profiles if p.profile_id == profileId), None)
        if profile is None:
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)
        items = []
        for start in profile.starts:
            placement = api.c_nvmlGpuInstancePlacement_t()
            placement.start = start
            placement.size = profile.memory_slices
            items.append(placement)
        self._fill(call, placementsRef, countRef, items, null_counts=True)
        return api.NVML_SUCCESS

    # -- GPU instances ------------------------------------------------------------------------

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: Any, profileId: int, placement: Any
    ) -> Any:
        call = "nvmlDeviceCreateGpuInstanceWithPlacement"
        profileId = _c_uint(2, profileId)
        requested = _deref(placement, "placement", call)  # before anything: it would crash
        gpu = self._device(call, device)
        gi = self.node.mig.create_gpu_instance(
            gpu.index, profileId, int(requested.start), int(requested.size)
        )
        return self._gi_handle(gpu, gi)

    def nvmlDeviceGetGpuInstances(
        self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any
    ) -> int:
        call = "nvmlDeviceGetGpuInstances"
        profileId = _c_uint(2, profileId)
        if gpuInstancesRef is not None:
            gpuInstancesRef = _c_array(call, 3, gpuInstancesRef, api.c_nvmlGpuInstance_t)
        gpu = self._device(call, device)
        geometry = self.node.mig.require_mig(gpu)
        if not any(p.profile_id == profileId for p in geometry.profiles):
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
        handles = [
            self._gi_handle(gpu, gi)
            for gi in sorted(gpu.instances.values(), key=lambda g: g.gi_id)
            if gi.profile.profile_id == profileId
        ]
        self._fill(call, gpuInstancesRef, countRef, handles)
        return api.NVML_SUCCESS

    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:
        gpuInstanceId = _c_uint(2, gpuInstanceId)
        gpu = self._device("nvmlDeviceGetGpuInstanceById", device)
        self.node.mig.require_mig(gpu)
        gi = gpu.instances.get(gpuInstanceId)
        if gi is None:
            # nvml.h: NOT_FOUND "If the GPU instance is not found".
            raise api.NVMLError(api.NVML_ERROR_NOT_FOUND)
        return self._gi_handle(gpu, gi)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        gpu, gi = self._gi("nvmlGpuInstanceGetInfo", gpuInstance)
        info = api.c_nvmlGpuInstanceInfo_t()
        info.device = self._handle(api.c_nvmlDevice_t, ("gpu", gpu.index))
        info.id = gi.gi_id
        info.profileId = gi.profile.profile_id
        info.placement.start = gi.start
        info.placement.size = gi.size
        return info

    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        _gpu, gi = self._gi("nvmlGpuInstanceDestroy", gpuInstance)
        self.node.mig.destroy_gpu_instance(gi.serial)
        return api.NVML_SUCCESS

    # -- compute instances ---------------------------------------------------------------------

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: Any, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        # pynvml names the first parameter "device", but it is the GPU instance handle.
        profile, engProfile = _c_uint(2, profile), _c_uint(3, engProfile)
        _gpu, gi = self._gi("nvmlGpuInstanceGetComputeInstanceProfileInfo", device)
        if version not in (1, 2) or (version == 2 and self.legacy_driver):
            raise api.NVMLError(api.NVML_ERROR_FUNCTION_NOT_FOUND)
        if engProfile != api.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            # go-nvml mock (pkg/nvml/mock/server/shared.go) answers NOT_SUPPORTED here too.
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)
        slices, count = self.node.mig.ci_profile(gi, profile)
        info: Any = (
            api.c_nvmlComputeInstanceProfileInfo_v2_t()
            if version == 2
            else api.c_nvmlComputeInstanceProfileInfo_t()
        )
        # CI profile IDs equal the enum index on A100/H100 (nvidia-smi mig -lcip shows 0..4)
        # and in the go-nvml mock; the REV1 duplicate answers with the 1-slice id (node.py).
        info.id = REV1_REPORTED_ID if profile == CI_PROFILE_1_SLICE_REV1 else profile
        info.sliceCount = slices
        info.instanceCount = count
        info.multiprocessorCount = (gi.profile.sm_count or 0) * slices // gi.profile.compute_slices
        if version == 2:
            full = slices == gi.profile.compute_slices
            info.name = f"MIG {gi.profile.name}" if full else f"MIG {slices}c.{gi.profile.name}"
        return info

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        profileId = _c_uint(2, profileId)
        gpu, gi = self._gi("nvmlGpuInstanceCreateComputeInstance", gpuInstance)
        ci = self.node.mig.create_compute_instance(gi.serial, profileId)
        return self._ci_handle(gpu, ci)

    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: Any, profileId: int, computeInstancesRef: Any, countRef: Any
    ) -> int:
        call = "nvmlGpuInstanceGetComputeInstances"
        profileId = _c_uint(2, profileId)
        if computeInstancesRef is not None:
            computeInstancesRef = _c_array(
                call, 3, computeInstancesRef, api.c_nvmlComputeInstance_t
            )
        gpu, gi = self._gi(call, gpuInstance)
        self.node.mig.ci_profile(gi, profileId)  # INVALID_ARGUMENT / NOT_SUPPORTED as NVML
        handles = [
            self._ci_handle(gpu, ci)
            for ci in sorted(gi.cis.values(), key=lambda c: c.ci_id)
            if ci.profile_index == profileId
        ]
        self._fill(call, computeInstancesRef, countRef, handles)
        return api.NVML_SUCCESS

    def nvmlGpuInstanceGetComputeInstanceById(
        self, gpuInstance: Any, computeInstanceId: int
    ) -> Any:
        computeInstanceId = _c_uint(2, computeInstanceId)
        gpu, gi = self._gi("nvmlGpuInstanceGetComputeInstanceById", gpuInstance)
        ci = gi.cis.get(computeInstanceId)
        if ci is None:
            # nvml.h: NOT_FOUND "If the compute instance is not found".
            raise api.NVMLError(api.NVML_ERROR_NOT_FOUND)
        return self._ci_handle(gpu, ci)

    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> Any:
        key = self._key(computeInstance, ("ci",))
        self._enter("nvmlComputeInstanceGetInfo", key[1])
        gpu, gi, ci = self.node.mig.lookup_ci(key[2])
        info = api.c_nvmlComputeInstanceInfo_t()
        # nvml.h: "nvmlDevice_t device; //!< Parent device".
        info.device = (
            self._mig_handle(gpu, ci)
            if self.ci_info_device == "mig"
            else self._handle(api.c_nvmlDevice_t, ("gpu", gpu.index))
        )
        info.gpuInstance = self._gi_handle(gpu, gi)
        info.id = ci.ci_id
        info.profileId = ci.profile_index
        info.placement.start = 0
        info.placement.size = ci.slices
        return info

    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        key = self._key(computeInstance, ("ci",))
        self._enter("nvmlComputeInstanceDestroy", key[1])
        self.node.mig.destroy_compute_instance(key[2])
        return api.NVML_SUCCESS

    # -- MIG device handles --------------------------------------------------------------------

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        key = self._key(device, ("gpu", "mig"))
        self._enter("nvmlDeviceGetMaxMigDeviceCount", key[1])
        if key[0] == "mig":
            return 0  # a MIG device has no MIG devices under it
        # nvml.h: "Returns zero if MIG is not supported or enabled."
        return self.node.mig.max_mig_devices(key[1])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        if not isinstance(index, int):  # pynvml: c_uint(index)
            raise TypeError(f"'{type(index).__name__}' object cannot be interpreted as an integer")
        gpu = self._device("nvmlDeviceGetMigDeviceHandleByIndex", device)
        if not 0 <= index < self.node.mig.max_mig_devices(gpu.index):
            # nvml.h: INVALID_ARGUMENT "if device, index or migDevice reference is invalid".
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
        found = self.node.mig.mig_device_at(gpu.index, index)
        if found is None:
            # nvml.h: NOT_FOUND "if no valid MIG device was found at index".
            raise api.NVMLError(api.NVML_ERROR_NOT_FOUND)
        return self._mig_handle(gpu, found[1])

    def _mig_only(
        self, call: str, device: Any
    ) -> tuple[SimGpu, SimGpuInstance, SimComputeInstance]:
        gpu, gi, ci = self._device_or_mig(call, device)
        if gi is None or ci is None:
            # nvml.h: NOT_SUPPORTED "if this query is not supported by the device" (a parent).
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)
        return gpu, gi, ci

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        _gpu, gi, _ci = self._mig_only("nvmlDeviceGetGpuInstanceId", device)
        return gi.gi_id

    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        _gpu, _gi, ci = self._mig_only("nvmlDeviceGetComputeInstanceId", device)
        return ci.ci_id

    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> Any:
        _gpu, gi, _ci = self._device_or_mig("nvmlDeviceIsMigDeviceHandle", device)
        # pynvml returns the ctypes c_uint itself here, not its value.
        return ctypes.c_uint(int(gi is not None))

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: Any) -> Any:
        gpu, _gi, _ci = self._device_or_mig(
            "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", migDevice
        )
        if _gi is None:
            # nvml.h: INVALID_ARGUMENT "if migDevice or device is invalid".
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
        return self._handle(api.c_nvmlDevice_t, ("gpu", gpu.index))

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: Any, profileId: int) -> int:
        profileId = _c_uint(2, profileId)
        gpu = self._device("nvmlDeviceGetGpuInstanceRemainingCapacity", device)
        geometry = self.node.mig.require_mig(gpu)
        profile = next((p for p in geometry.profiles if p.profile_id == profileId), None)
        if profile is None:
            # nvml.h: NOT_SUPPORTED "If device doesn't have MIG mode enabled or profileId
            # isn't supported".
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)
        return self.node.mig.remaining_capacity(gpu.index, profile)

    def nvmlDeviceGetGpuInstanceProfileInfoById(self, device: Any, profileId: int) -> Any:
        profileId = _c_uint(2, profileId)
        gpu = self._device("nvmlDeviceGetGpuInstanceProfileInfoById", device)
        if self.legacy_driver:  # ...ByIdV is as new as ...ProfileInfoV
            raise api.NVMLError(api.NVML_ERROR_FUNCTION_NOT_FOUND)
        geometry = self.node.mig.require_mig(gpu)
        found = next((p for p in geometry.profiles if p.profile_id == profileId), None)
        if found is None:
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)
        return self._profile_info(found, 2)

    # -- processes ------------------------------------------------------------------------------

    def _process_list(self, call: str, handle: Any, mps: bool) -> list[Any]:
        gpu, _gi, ci = self._device_or_mig(call, handle)
        if ci is None and gpu.mig_current and not self.node.is_root:
            # nvml.h (nvmlDeviceGetComputeRunningProcesses_v3): "In MIG mode, if device handle
            # is provided, the API returns aggregate information, only if the caller has
            # appropriate privileges".
            raise api.NVMLError(api.NVML_ERROR_NO_PERMISSION)
        procs = self.node.procs.processes_on(gpu.index, ci.serial if ci is not None else None)
        return [self._friendly(gpu, p) for p in procs if p.mps == mps]

    def _friendly(self, gpu: SimGpu, proc: SimProcess) -> api.nvmlFriendlyObject:
        gi_id = ci_id = api.VALUE_NOT_AVAILABLE_UINT
        if proc.ci_serial is not None:
            _g, gi, ci = self.node.mig.lookup_ci(proc.ci_serial)
            gi_id, ci_id = gi.gi_id, ci.ci_id
        return api.nvmlFriendlyObject(
            {
                "pid": proc.pid,
                # pynvml turns NVML_VALUE_NOT_AVAILABLE_ulonglong into None.
                "usedGpuMemory": proc.used_mib * MIB if self.node.used_memory_visible else None,
                "gpuInstanceId": gi_id,
                "computeInstanceId": ci_id,
            }
        )

    def _versioned(self, call: str) -> None:
        if self.legacy_driver:
            # pynvml.py throwOnVersionMismatch: FUNCTION_NOT_FOUND of the _v3 symbol
            # becomes NVMLLibraryMismatchError naming the versioned function to use.
            self.node.check_call(call)
            raise api.NVMLLibraryMismatchError(
                "Unversioned function called and the pyNVML version does not match the NVML "
                f"lib version. Either use matching pyNVML and NVML lib versions or use a "
                f"versioned function such as {call}_v2"
            )

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        self._versioned("nvmlDeviceGetComputeRunningProcesses")
        return self._process_list("nvmlDeviceGetComputeRunningProcesses", handle, mps=False)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
        return self._process_list("nvmlDeviceGetComputeRunningProcesses_v2", handle, mps=False)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[Any]:
        self._versioned("nvmlDeviceGetMPSComputeRunningProcesses")
        return self._process_list("nvmlDeviceGetMPSComputeRunningProcesses", handle, mps=True)

    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, handle: Any) -> list[Any]:
        return self._process_list("nvmlDeviceGetMPSComputeRunningProcesses_v2", handle, mps=True)


FAKE_FUNCTIONS: tuple[str, ...] = tuple(
    name for name, value in vars(FakePynvml).items() if name.startswith("nvml") and callable(value)
)
"""Every pynvml function the stand-in implements (tests compare their signatures)."""

__all__ = ["FAKE_FUNCTIONS", "PRIVILEGED_CALLS", "WRITE_CALLS", "FakePynvml"]
