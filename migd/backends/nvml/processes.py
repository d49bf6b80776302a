"""Process listing and memory sampling on one device handle (a whole GPU or a MIG device).

Which handle to read (and the MIG UUIDs of the processes' instances) is the boundary's
business (:class:`~migd.backends.nvml.backend.NvmlBackend`); these functions make the
NVML calls and turn their answers into :class:`~migd.ports.GpuProcess` and
:class:`~migd.ports.MemoryInfo`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from migd.backends.nvml.errors import is_library_mismatch, nvml_errors
from migd.errors import GpuUnsupported
from migd.ports import GpuProcess, MemoryInfo

MIB = 1024 * 1024

_NOT_AVAILABLE_UINT = 0xFFFFFFFF  # gpuInstanceId of a process outside MIG


def mib_up(byte_count: int) -> int:
    """Bytes in MiB, rounded up (a used byte is a used MiB)."""
    return -(-byte_count // MIB)


def read_memory(nvml: Any, handle: Any, gpu: int, mig_uuid: str | None) -> MemoryInfo:
    """Total and used memory of one device handle."""
    with nvml_errors("read memory", gpu=gpu, mig_uuid=mig_uuid):
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    return MemoryInfo(total_mib=int(memory.total) // MIB, used_mib=mib_up(int(memory.used)))


def instance_ids(proc: Any) -> tuple[int, int] | None:
    """(GPU instance id, compute instance id) of an NVML process entry; None outside MIG."""
    gi_id = getattr(proc, "gpuInstanceId", None)
    ci_id = getattr(proc, "computeInstanceId", None)
    if not isinstance(gi_id, int) or not isinstance(ci_id, int) or gi_id == _NOT_AVAILABLE_UINT:
        return None
    return gi_id, ci_id


def list_raw_processes(
    nvml: Any,
    gpu: int,
    handle: Any,
    mig_uuid: str | None,
    no_mps_listing: Callable[[GpuUnsupported], None],
) -> list[tuple[Any, bool]]:
    """NVML's compute and MPS client process entries on one handle: (entry, listed as MPS).

    ``no_mps_listing`` is told when the GPU or driver cannot list MPS clients; the
    compute processes are still listed then.
    """
    with nvml_errors("list compute processes", gpu=gpu, mig_uuid=mig_uuid):
        raw = [
            (proc, False)
            for proc in _process_list(nvml, "nvmlDeviceGetComputeRunningProcesses", handle)
        ]
    try:
        with nvml_errors("list MPS client processes", gpu=gpu, mig_uuid=mig_uuid):
            raw += [
                (proc, True)
                for proc in _process_list(nvml, "nvmlDeviceGetMPSComputeRunningProcesses", handle)
            ]
    except GpuUnsupported as err:  # pre-Volta, or an old driver: no MPS listing
        no_mps_listing(err)
    return raw


def merge_processes(
    gpu: int,
    raw: list[tuple[Any, bool]],
    mig_uuid: str | None,
    uuid_of: dict[tuple[int, int], str],
) -> list[GpuProcess]:
    """One :class:`GpuProcess` per pid, by pid; ``uuid_of`` names the MIG devices by ids."""
    merged: dict[int, GpuProcess] = {}
    for proc, listed_as_mps in raw:
        pid = int(proc.pid)
        used = getattr(proc, "usedGpuMemory", None)
        used_mib = None if used is None else mib_up(int(used))
        uuid = mig_uuid or uuid_of.get(instance_ids(proc) or (-1, -1))
        previous = merged.get(pid)
        mps = listed_as_mps or (previous is not None and previous.mps)
        if previous is not None and (previous.used_mib or 0) >= (used_mib or 0):
            used_mib = previous.used_mib  # listed twice (compute and MPS): the larger
        merged[pid] = GpuProcess(pid=pid, used_mib=used_mib, gpu=gpu, mig_uuid=uuid, mps=mps)
    return [merged[pid] for pid in sorted(merged)]


def _process_list(nvml: Any, function: str, handle: Any) -> list[Any]:
    """One pynvml process query; the ``_v2`` variant where the driver predates ``_v3``."""
    try:
        return list(getattr(nvml, function)(handle))
    except Exception as exc:
        older = getattr(nvml, f"{function}_v2", None)
        if is_library_mismatch(exc) and older is not None:
            return list(older(handle))
        raise
