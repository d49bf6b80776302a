"""Per-cgroup device-memory limits through NVML: the MPS v3 path, behind detection.

NVIDIA's driver r615 / CUDA 13.4 adds memory partitioning: a cgroup's processes get a hard
(``dmem.max``) and soft (``dmem.min``) device-memory limit, set with
``nvmlDeviceSetMemoryLimits_v1(device, {nameSpace = cgroup path, softLimit, hardLimit})``
and read with ``nvmlDeviceGetMemoryLimits_v1`` (which also says ``currentUsed``). Sources:
docs.nvidia.com/deploy/mps/latest/mpsv3-memory-partitioning.html (cgroup v2, CUDA 13.4+,
"a non-MIG device"), docs.nvidia.com/deploy/nvml-api/api/structnvmlSetMemoryLimits__v1__t.html
and ...structnvmlGetMemoryLimits__v1__t.html (bytes; "To clear the limits, set softLimit
to 0, and hardLimit to NVML_DEVICE_MEMORY_LIMIT_MAX. Removing the cgroup will also clear
any limits"), and the cuda-python bindings' docstrings ("Requires root/admin permissions",
"MIG handles are not supported").

:class:`NvmlCgroupLimits` is the :class:`~migd.ports.CgroupMemoryLimits` adapter. NOT
VERIFIED on hardware: the lent machines run driver 580. The Python names follow NVML's C
names as nvidia-ml-py does for every other call (``nvmlDeviceSetMemoryLimits_v1``, the
structure ``c_nvmlSetMemoryLimits_v1_t``); a binding without them is reported as
unsupported, never called. docs/mps.md, "MPS v3", has the design and what stays open.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from migd.backends.nvml.errors import nvml_errors
from migd.core.mps import MPS_V3_NVML_SYMBOL, mps_v3_unsupported
from migd.ports import CgroupMemoryLimit

#: ``NVML_DEVICE_MEMORY_LIMIT_MAX``: "no hard limit". Its value is not in the docs we
#: have; the largest unsigned 64-bit value is assumed (NOT VERIFIED), and any hard limit
#: at or above the GPU's memory is read as none.
NVML_DEVICE_MEMORY_LIMIT_MAX = (1 << 64) - 1
_MIB = 1 << 20
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_v2(root: Path = CGROUP_ROOT) -> bool:
    """Whether ``root`` is a cgroup v2 (unified) hierarchy: it has ``cgroup.controllers``."""
    return (root / "cgroup.controllers").is_file()


def has_symbol(nvml: Any, name: str = MPS_V3_NVML_SYMBOL) -> bool:
    """Whether the NVML library (not only the binding) has ``name``.

    nvidia-ml-py looks C functions up lazily (``_nvmlGetFunctionPointer``, which raises
    ``NVML_ERROR_FUNCTION_NOT_FOUND`` for a symbol the installed library lacks).
    """
    if not hasattr(nvml, name):
        return False
    lookup = getattr(nvml, "_nvmlGetFunctionPointer", None)
    if lookup is None:
        return True
    try:
        lookup(name)
    except Exception:  # the library predates the call: unsupported, not an error
        return False
    return True


class NvmlCgroupLimits:
    """:class:`~migd.ports.CgroupMemoryLimits` on NVML (``nvml``: pynvml or a stand-in)."""

    def __init__(
        self,
        nvml: Any = None,
        *,
        cgroup_root: Path = CGROUP_ROOT,
        load: Callable[[], Any] | None = None,
    ) -> None:
        """``nvml``, or ``load`` to get it at first use (the daemon's NVML backend's
        initialised module: NVML is not touched before the daemon opens)."""
        self._nvml = nvml
        self._load = load
        self.cgroup_root = cgroup_root

    @property
    def nvml(self) -> Any:
        if self._nvml is None and self._load is not None:
            self._nvml = self._load()
        return self._nvml

    def support(self, gpu: int) -> str | None:
        nvml = self.nvml
        with nvml_errors("detect per-cgroup memory limits", gpu=gpu):
            driver = nvml.nvmlSystemGetDriverVersion()
            driver = driver.decode() if isinstance(driver, bytes) else str(driver)
            handle = nvml.nvmlDeviceGetHandleByIndex(gpu)
            try:
                current, _pending = nvml.nvmlDeviceGetMigMode(handle)
                mig = bool(current)
            except Exception:  # no MIG on this GPU model
                mig = False
        return mps_v3_unsupported(
            driver,
            has_symbol=has_symbol(nvml),
            mig_enabled=mig,
            cgroup_v2=cgroup_v2(self.cgroup_root),
        )

    def _limits(self, cgroup: str, soft: int, hard: int) -> Any:
        make = getattr(self.nvml, "c_nvmlSetMemoryLimits_v1_t", None)
        limits = make() if make is not None else SimpleNamespace()
        limits.nameSpace = cgroup
        limits.softLimit = soft
        limits.hardLimit = hard
        return limits

    def set_limit(self, gpu: int, cgroup: str, hard_mib: int, soft_mib: int = 0) -> None:
        if hard_mib <= 0 or soft_mib < 0 or soft_mib > hard_mib:
            raise ValueError(f"limits must be 0 <= soft <= hard, hard > 0: {soft_mib}, {hard_mib}")
        nvml = self.nvml
        with nvml_errors(f"limit cgroup {cgroup} to {hard_mib} MiB", gpu=gpu, cgroup=cgroup):
            handle = nvml.nvmlDeviceGetHandleByIndex(gpu)
            nvml.nvmlDeviceSetMemoryLimits_v1(
                handle, self._limits(cgroup, soft_mib * _MIB, hard_mib * _MIB)
            )

    def clear_limit(self, gpu: int, cgroup: str) -> None:
        nvml = self.nvml
        with nvml_errors(f"clear the limits of cgroup {cgroup}", gpu=gpu, cgroup=cgroup):
            handle = nvml.nvmlDeviceGetHandleByIndex(gpu)
            nvml.nvmlDeviceSetMemoryLimits_v1(
                handle, self._limits(cgroup, 0, NVML_DEVICE_MEMORY_LIMIT_MAX)
            )

    def get_limit(self, gpu: int, cgroup: str) -> CgroupMemoryLimit:
        nvml = self.nvml
        with nvml_errors(f"read the limits of cgroup {cgroup}", gpu=gpu, cgroup=cgroup):
            handle = nvml.nvmlDeviceGetHandleByIndex(gpu)
            got = nvml.nvmlDeviceGetMemoryLimits_v1(handle, cgroup)
        hard = int(got.hardLimit)
        return CgroupMemoryLimit(
            cgroup=cgroup,
            soft_mib=int(got.softLimit) // _MIB,
            hard_mib=None if hard >= NVML_DEVICE_MEMORY_LIMIT_MAX else hard // _MIB,
            used_mib=int(got.currentUsed) // _MIB,
        )
