"""A stand-in for NVML's per-cgroup memory limits (MPS v3 memory partitioning).

Behaves as NVIDIA documents it (docs.nvidia.com/deploy/mps/latest/
mpsv3-memory-partitioning.html; docs.nvidia.com/deploy/nvml-api/api/
structnvmlSetMemoryLimits__v1__t.html and structnvmlGetMemoryLimits__v1__t.html; the
cuda-python binding docstrings of device_set/get_memory_limits_v1):

* the call exists from driver r615 (CUDA 13.4): an older driver has no symbol
  (``NVML_ERROR_FUNCTION_NOT_FOUND`` from the lookup);
* setting "Requires root/admin permissions" (``NVML_ERROR_NO_PERMISSION`` otherwise;
  reading does not say so and is allowed);
* "MIG handles are not supported", and it needs "a non-MIG device": a GPU with MIG
  enabled answers ``NVML_ERROR_NOT_SUPPORTED``;
* ``nameSpace`` is the "Full path to sysfs cgroup file name"; limits are bytes; the soft
  limit is "guaranteed before allocations may fail due to memory pressure", the hard
  limit "the maximum amount of memory that can be allocated"; soft 0 with hard
  ``NVML_DEVICE_MEMORY_LIMIT_MAX`` clears them, and so does removing the cgroup;
* reading gives ``softLimit``, ``hardLimit`` and ``currentUsed``;
* memory partitioning "requires cgroup v2" (mpsv3-memory-partitioning.html): with a
  ``cgroup_root`` that is not a unified (v2) hierarchy (no ``cgroup.controllers``) the
  calls are refused;
* the hard limit is "the maximum amount of memory that can be allocated" of the device
  ("cross-referenced with nvmlDeviceGetMemoryInfo_v2"): a hard limit above the device's
  memory is refused (other than ``NVML_DEVICE_MEMORY_LIMIT_MAX``, which clears).

Made up (not documented): the error codes for a path that is not a cgroup directory or not
under the cgroup root (``NVML_ERROR_INVALID_ARGUMENT`` here), for a cgroup v1 host
(``NVML_ERROR_NOT_SUPPORTED``), for a hard limit above the device
(``NVML_ERROR_INVALID_ARGUMENT``), and ``NVML_DEVICE_MEMORY_LIMIT_MAX``'s value.

With ``node`` (a :class:`~migd.backends.simulated.node.SimNode`), the driver version, the
GPU count, each GPU's MIG mode and its memory are the node's, so a simulated daemon's
detection follows its node description (``driver_version = "615.10.01"``).
``alloc`` stands for a process of the cgroup allocating: past the hard limit it fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from migd.backends.mps.dmem import NVML_DEVICE_MEMORY_LIMIT_MAX
from migd.backends.simulated import nvml_api as api
from migd.core.mps import MPS_V3_MIN_DRIVER_MAJOR, MPS_V3_NVML_SYMBOL

if TYPE_CHECKING:
    from migd.backends.simulated.node import SimNode


@dataclass
class _Handle:
    index: int


@dataclass
class SimDmemNvml:
    """The NVML calls :class:`~migd.backends.mps.dmem.NvmlCgroupLimits` makes."""

    driver_version: str = "615.10.01"
    gpus: int = 1
    mig_enabled: frozenset[int] = frozenset()
    is_root: bool = True
    #: The cgroup hierarchy's root: limits only for paths under it, and only if it is v2.
    #: ``None``: any cgroup directory, v2 assumed (the unit tests of the adapter).
    cgroup_root: Path | None = None
    memory_mib: int = 81920  # each GPU's memory (without ``node``)
    node: SimNode | None = None
    # (gpu, cgroup path) -> [soft bytes, hard bytes, used bytes]
    limits: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    #: Every set/clear call, for tests (``("set", gpu, cgroup, hard bytes)``).
    calls: list[tuple[str, int, str, int]] = field(default_factory=list)

    NVMLError = api.NVMLError

    def _driver(self) -> str:
        return self.node.driver_version if self.node is not None else self.driver_version

    def _supported(self) -> bool:
        try:
            major = int(self._driver().split(".")[0])
        except ValueError:
            return False
        return major >= MPS_V3_MIN_DRIVER_MAJOR

    def _mig(self, index: int) -> bool:
        if self.node is not None:
            return bool(self.node.gpu(index).mig_current)
        return index in self.mig_enabled

    def _device_bytes(self, index: int) -> int:
        if self.node is not None:
            return int(self.node.gpu(index).spec.memory_total_mib) << 20
        return self.memory_mib << 20

    def _nvmlGetFunctionPointer(self, name: str) -> object:
        if name == MPS_V3_NVML_SYMBOL and not self._supported():
            raise api.NVMLError(api.NVML_ERROR_FUNCTION_NOT_FOUND)
        return object()

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._driver()

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        count = self.node.gpu_count if self.node is not None else self.gpus
        if not 0 <= index < count:
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> tuple[int, int]:
        mig = int(self._mig(handle.index))
        return mig, mig

    def _check(self, handle: _Handle, cgroup: str) -> None:
        if not self._supported():
            raise api.NVMLError(api.NVML_ERROR_FUNCTION_NOT_FOUND)
        if self._mig(handle.index):
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)
        root = self.cgroup_root
        if root is not None and not (root / "cgroup.controllers").is_file():
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)  # cgroup v1: "requires v2"
        path = Path(cgroup)
        if root is not None and not path.resolve().is_relative_to(root.resolve()):
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
        if not (path / "cgroup.procs").exists():
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceSetMemoryLimits_v1(self, handle: _Handle, limits: Any) -> None:
        if not self.is_root:
            raise api.NVMLError(api.NVML_ERROR_NO_PERMISSION)
        self._check(handle, limits.nameSpace)
        key = (handle.index, str(limits.nameSpace))
        if limits.softLimit == 0 and limits.hardLimit == NVML_DEVICE_MEMORY_LIMIT_MAX:
            self.calls.append(("clear", handle.index, key[1], int(limits.hardLimit)))
            self.limits.pop(key, None)
            return
        if int(limits.hardLimit) > self._device_bytes(handle.index):
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
        self.calls.append(("set", handle.index, key[1], int(limits.hardLimit)))
        used = self.limits.get(key, [0, 0, 0])[2]
        self.limits[key] = [int(limits.softLimit), int(limits.hardLimit), used]

    def nvmlDeviceGetMemoryLimits_v1(self, handle: _Handle, cgroup: str) -> Any:
        self._check(handle, cgroup)
        self._forget_removed()
        soft, hard, used = self.limits.get(
            (handle.index, cgroup), [0, NVML_DEVICE_MEMORY_LIMIT_MAX, 0]
        )
        return SimpleNamespace(nameSpace=cgroup, softLimit=soft, hardLimit=hard, currentUsed=used)

    def _forget_removed(self) -> None:
        """ "Removing the cgroup will also clear any limits"."""
        for key in [k for k in self.limits if not (Path(k[1]) / "cgroup.procs").exists()]:
            del self.limits[key]

    def alloc(self, gpu: int, cgroup: str, mib: int) -> bool:
        """A process of ``cgroup`` allocates ``mib``: False (its OOM) past the hard limit."""
        self._forget_removed()
        entry = self.limits.get((gpu, cgroup))
        if entry is None:
            return True
        if entry[2] + mib * (1 << 20) > entry[1]:
            return False
        entry[2] += mib * (1 << 20)
        return True
