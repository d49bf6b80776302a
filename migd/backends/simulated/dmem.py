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
* reading gives ``softLimit``, ``hardLimit`` and ``currentUsed``.

Made up (not documented): the error for a path that is not a cgroup directory
(``NVML_ERROR_INVALID_ARGUMENT`` here) and ``NVML_DEVICE_MEMORY_LIMIT_MAX``'s value.
``alloc`` stands for a process of the cgroup allocating: past the hard limit it fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from migd.backends.mps.dmem import NVML_DEVICE_MEMORY_LIMIT_MAX
from migd.backends.simulated import nvml_api as api
from migd.core.mps import MPS_V3_MIN_DRIVER_MAJOR, MPS_V3_NVML_SYMBOL


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
    # (gpu, cgroup path) -> [soft bytes, hard bytes, used bytes]
    limits: dict[tuple[int, str], list[int]] = field(default_factory=dict)

    NVMLError = api.NVMLError

    def _supported(self) -> bool:
        return int(self.driver_version.split(".")[0]) >= MPS_V3_MIN_DRIVER_MAJOR

    def _nvmlGetFunctionPointer(self, name: str) -> object:
        if name == MPS_V3_NVML_SYMBOL and not self._supported():
            raise api.NVMLError(api.NVML_ERROR_FUNCTION_NOT_FOUND)
        return object()

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver_version

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        if not 0 <= index < self.gpus:
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> tuple[int, int]:
        mig = int(handle.index in self.mig_enabled)
        return mig, mig

    def _check(self, handle: _Handle, cgroup: str) -> None:
        if not self._supported():
            raise api.NVMLError(api.NVML_ERROR_FUNCTION_NOT_FOUND)
        if handle.index in self.mig_enabled:
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)
        if not (Path(cgroup) / "cgroup.procs").exists():
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceSetMemoryLimits_v1(self, handle: _Handle, limits: Any) -> None:
        if not self.is_root:
            raise api.NVMLError(api.NVML_ERROR_NO_PERMISSION)
        self._check(handle, limits.nameSpace)
        key = (handle.index, str(limits.nameSpace))
        if limits.softLimit == 0 and limits.hardLimit == NVML_DEVICE_MEMORY_LIMIT_MAX:
            self.limits.pop(key, None)
            return
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
