"""GPU discovery through NVML: one GPU's identity, modes and memory as a :class:`GpuInfo`.

Functions over a ``pynvml``-compatible module ``nvml`` and a GPU handle; the boundary
(:class:`~migd.backends.nvml.backend.NvmlBackend`) caches what they read. Reads that
only add detail (compute capability, persistence and compute mode, versions) degrade to
``None`` and are logged once (:func:`degradable`); a lost GPU or a missing driver still
raises, and so does a MIG mode that cannot be read (:func:`read_mig_mode`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from migd.backends.nvml.errors import nvml_errors
from migd.backends.nvml.processes import MIB
from migd.core import catalog
from migd.errors import (
    DriverUnavailable,
    GpuError,
    GpuNotFound,
    GpuPermissionDenied,
    GpuUnsupported,
)
from migd.ports import GpuInfo

# nvmlComputeMode_t (nvml.h): 1, EXCLUSIVE_THREAD, was removed from the driver.
COMPUTE_MODE_NAMES: dict[int, str] = {0: "DEFAULT", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}


class LogOnce(Protocol):
    """The boundary's log-once: a message under ``key`` is logged the first time only."""

    def __call__(self, key: str, message: str, *args: Any, level: int = ...) -> None: ...


def text(value: Any) -> str:
    """A pynvml string result: ``str`` (pynvml decodes most) or ``bytes`` (raw fields)."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)


def read_gpu(
    nvml: Any, handle: Any, gpu: int, versions: tuple[str, str], log_once: LogOnce
) -> GpuInfo:
    """One GPU's :class:`GpuInfo`; reads that only add detail are ``None`` if NVML cannot say."""
    driver, cuda = versions
    with nvml_errors("read GPU identity", gpu=gpu):
        uuid = text(nvml.nvmlDeviceGetUUID(handle))
        name = text(nvml.nvmlDeviceGetName(handle))
        pci = nvml.nvmlDeviceGetPciInfo(handle)
    total_mib = _memory_total(nvml, handle, gpu, int(pci.pciDeviceId), name, log_once)
    mig_error: str | None = None
    try:
        mig_current, mig_pending = read_mig_mode(nvml, handle, gpu, log_once)
    except (GpuNotFound, DriverUnavailable):
        raise
    except GpuError as err:  # unknown is not "no MIG": the daemon gives it no work
        mig_current = mig_pending = None
        mig_error = err.message
    capability = degradable(
        log_once,
        "read compute capability",
        gpu,
        lambda: tuple(int(v) for v in nvml.nvmlDeviceGetCudaComputeCapability(handle)),
    )
    persistence = degradable(
        log_once,
        "read persistence mode",
        gpu,
        lambda: int(nvml.nvmlDeviceGetPersistenceMode(handle)),
    )
    if persistence == 0:
        log_once(
            f"persistence:{gpu}",
            "GPU %d (%s) has persistence mode off: when it goes idle the driver may "
            "de-initialise it and its MIG instances are lost; enable nvidia-persistenced "
            "(docs/operations.md)",
            gpu,
            uuid,
        )
    compute_mode = degradable(
        log_once, "read compute mode", gpu, lambda: int(nvml.nvmlDeviceGetComputeMode(handle))
    )
    pci_device_id = int(pci.pciDeviceId)
    return GpuInfo(
        index=gpu,
        uuid=uuid,
        name=name,
        pci_bus_id=text(pci.busId),
        pci_device_id=pci_device_id,
        memory_total_mib=total_mib,
        mig_current=mig_current,
        mig_pending=mig_pending,
        driver_version=driver,
        cuda_version=cuda,
        model=catalog.detect_model(pci_device_id, name, total_mib),
        compute_capability=(capability[0], capability[1]) if capability else None,
        mig_mode_error=mig_error,
        persistence_mode=None if persistence is None else persistence != 0,
        compute_mode=None if compute_mode is None else COMPUTE_MODE_NAMES.get(compute_mode),
    )


def _memory_total(
    nvml: Any, handle: Any, gpu: int, pci_device_id: int, name: str, log_once: LogOnce
) -> int:
    """The whole GPU's memory in MiB.

    In MIG mode nvml.h gives the parent's aggregate "only if the caller has
    appropriate privileges"; without them (a probe run as a normal user) the catalog's
    size for the model stands in, and 0 where the model is unknown.
    """
    try:
        with nvml_errors("read GPU memory", gpu=gpu):
            return int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB
    except GpuPermissionDenied as err:
        model = catalog.detect_model(pci_device_id, name)
        known = catalog.builtin_models().get(model or "")
        log_once(
            f"memory:{gpu}",
            "%s; using the catalog's size for %s",
            err,
            model or "an unknown model (0)",
            level=logging.INFO,
        )
        return known.memory_mib if known is not None else 0


def read_mig_mode(
    nvml: Any, handle: Any, gpu: int, log_once: LogOnce
) -> tuple[bool | None, bool | None]:
    """(current, pending) MIG mode; (None, None) where the GPU has no MIG.

    Raises:
        GpuError: NVML could not read the mode (e.g. NVML_ERROR_UNKNOWN). That is not
            "no MIG": a MIG GPU managed as a whole GPU would be handed out wrongly.
    """
    try:
        with nvml_errors("read MIG mode", gpu=gpu):
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
    except GpuUnsupported:
        return None, None
    except (GpuNotFound, DriverUnavailable):
        raise
    except GpuError as err:
        log_once(f"migmode:{gpu}", "%s; MIG mode unknown", err)
        raise GpuError(
            f"the MIG mode of GPU {gpu} cannot be read ({err.message})",
            hint="`nvidia-smi -q -i N` shows whether the driver can say; restart migd "
            "once it does (the GPU gets no work until then)",
            **err.details,
        ) from err
    return bool(current), bool(pending)


def read_driver_versions(nvml: Any, log_once: LogOnce) -> tuple[str, str]:
    """(driver version, CUDA version as "12.4"); empty where NVML cannot say."""
    driver = degradable(
        log_once, "read driver version", None, lambda: text(nvml.nvmlSystemGetDriverVersion())
    )
    cuda_int = degradable(
        log_once, "read CUDA version", None, lambda: int(nvml.nvmlSystemGetCudaDriverVersion())
    )
    cuda = f"{cuda_int // 1000}.{cuda_int % 1000 // 10}" if cuda_int else ""
    return driver or "", cuda


def degradable(log_once: LogOnce, op: str, gpu: int | None, read: Callable[[], Any]) -> Any:
    """Run a read that only adds detail: ``None`` (logged once) if NVML cannot say.

    A lost GPU or a missing driver still raises: those are not details.
    """
    try:
        with nvml_errors(op, gpu=gpu):
            return read()
    except (GpuNotFound, DriverUnavailable):
        raise
    except GpuError as err:
        log_once(f"{op}:{gpu}", "%s; reported as unknown", err, level=logging.INFO)
        return None
