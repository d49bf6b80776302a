"""MIG through NVML: profiles, placements, compute instances, create and roll back.

Functions over a ``pynvml``-compatible module ``nvml`` and the handles it gave; the
caches (profiles, GPU infos) and the order of the calls are the boundary's
(:class:`~migd.backends.nvml.backend.NvmlBackend`). Conventions relied on (pynvml of
nvidia-ml-py 13.615.71):

* list calls fill a caller-allocated ctypes array and write the count through
  ``ctypes.byref(c_uint)``; arrays are sized from the profile's instance count;
* the placement given to ``nvmlDeviceCreateGpuInstanceWithPlacement`` is passed with
  ``ctypes.byref`` (see :func:`create_gpu_instance`).

Which MIG device (UUID, handle) a compute instance has is
:mod:`migd.backends.nvml.mig_devices`' job.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from migd.backends.nvml.discovery import text
from migd.backends.nvml.errors import (
    MigModeReader,
    nvml_error_code,
    nvml_errors,
    versioned_info,
)
from migd.backends.nvml_codes import (
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_SUPPORTED,
)
from migd.core.geometry import Geometry, NvmlProfileInfo, Profile
from migd.errors import (
    GpuUnsupported,
    IllegalTransition,
    InsufficientResources,
    InvalidStart,
    MigdError,
    PlacementOverlap,
)
from migd.ports import MigInstance

# The package's name, as before the split: log filters and docs name this logger.
_log = logging.getLogger("migd.backends.nvml")

# Codes that mean "this profile index does not exist here" when enumerating profiles
# (nvml.h: enumerate "until the API returns NVML_ERROR_INVALID_ARGUMENT"; NOT_SUPPORTED
# "if profile isn't supported").
_ABSENT = frozenset({NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT})

# Looks (after the first) for a new compute instance's MIG device handle: with a 0.2 s
# back-off doubling each time, about 6 s in all.
MIG_HANDLE_RETRIES = 5


@dataclass(frozen=True, slots=True)
class CiProfile:
    """A compute instance profile a GPU instance supports."""

    index: int  # NVML_COMPUTE_INSTANCE_PROFILE_*
    profile_id: int
    instance_count: int
    slices: int


# -- profiles and placements ------------------------------------------------------------------


def _profile_indices(nvml: Any, prefix: str) -> list[int]:
    """The values of pynvml's ``<prefix>*`` profile constants (not the ``_COUNT``)."""
    return sorted(
        {
            int(getattr(nvml, name))
            for name in dir(nvml)
            if name.startswith(prefix) and not name.endswith("_COUNT")
        }
    )


def read_profile_infos(
    nvml: Any, handle: Any, gpu: int, mig_mode: MigModeReader
) -> list[tuple[NvmlProfileInfo, dict[str, int]]]:
    """Every GPU instance profile of the GPU (``-lgip``) with its engine counts."""
    seen: set[int] = set()
    out: list[tuple[NvmlProfileInfo, dict[str, int]]] = []
    for index in _profile_indices(nvml, "NVML_GPU_INSTANCE_PROFILE_"):
        with nvml_errors("read MIG profile info", gpu=gpu, nvml_index=index, mig_mode=mig_mode):
            try:
                raw = versioned_info(nvml.nvmlDeviceGetGpuInstanceProfileInfo, handle, index)
            except Exception as exc:
                if nvml_error_code(exc) in _ABSENT:
                    continue  # the index is not a profile of this GPU / driver
                raise
        profile_id = int(raw.id)
        if profile_id in seen:
            continue
        seen.add(profile_id)
        out.append(
            (
                NvmlProfileInfo(
                    nvml_index=index,
                    profile_id=profile_id,
                    compute_slices=int(raw.sliceCount),
                    max_instances=int(raw.instanceCount),
                    memory_mib=int(raw.memorySizeMB),
                    name=text(getattr(raw, "name", "")),
                    multiprocessor_count=int(raw.multiprocessorCount) or None,
                ),
                {
                    "ce": int(raw.copyEngineCount),
                    "dec": int(raw.decoderCount),
                    "enc": int(raw.encoderCount),
                    "jpeg": int(raw.jpegCount),
                    "ofa": int(raw.ofaCount),
                },
            )
        )
    return out


def read_possible_placements(
    nvml: Any, handle: Any, gpu: int, profile_id: int, mig_mode: MigModeReader
) -> list[tuple[int, int]]:
    """``(start, size)`` of every placement of a profile, free or not (``-lgipp``)."""
    count = ctypes.c_uint(0)
    with nvml_errors("read possible placements", gpu=gpu, profile_id=profile_id, mig_mode=mig_mode):
        # First call with NULL: nvml.h "Can be NULL to discover number of allowed
        # placements"; then an array of exactly that size.
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(
            handle, profile_id, None, ctypes.byref(count)
        )
        array = (nvml.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(
            handle, profile_id, array, ctypes.byref(count)
        )
    return [(int(array[i].start), int(array[i].size)) for i in range(count.value)]


def list_gpu_instances(
    nvml: Any, handle: Any, gpu: int, profile: Profile, units: int, mig_mode: MigModeReader
) -> list[Any]:
    """The GPU instance handles of one profile on the GPU (``nvidia-smi mig -lgi``)."""
    count = ctypes.c_uint(0)
    # nvml.h: "the buffer must be large enough to accommodate the instances
    # supported by the profile".
    array = (nvml.c_nvmlGpuInstance_t * max(profile.max_instances, units))()
    with nvml_errors("list GPU instances", gpu=gpu, profile=profile.name, mig_mode=mig_mode):
        nvml.nvmlDeviceGetGpuInstances(handle, profile.profile_id, array, ctypes.byref(count))
    return [array[i] for i in range(count.value)]


# -- compute instances ------------------------------------------------------------------------


def read_ci_profiles(nvml: Any, gpu: int, gi: Any) -> list[CiProfile]:
    """Compute instance profiles the GPU instance ``gi`` supports, largest first."""
    found: list[CiProfile] = []
    for index in _profile_indices(nvml, "NVML_COMPUTE_INSTANCE_PROFILE_"):
        with nvml_errors("read compute instance profile", gpu=gpu, ci_index=index):
            try:
                raw = versioned_info(
                    nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo,
                    gi,
                    index,
                    nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                )
            except Exception as exc:
                if nvml_error_code(exc) in _ABSENT:
                    continue
                raise
        profile_id = int(raw.id)
        if any(c.profile_id == profile_id for c in found):
            # The same profile under a second index (COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1
            # answering with the 1-slice profile's id): listing its CIs again would
            # report each twice, and the second destroy would fail. NVIDIA's DRA driver
            # skips REV1 for the same reason (k8s-dra-driver-gpu,
            # cmd/gpu-kubelet-plugin/nvlib.go: "same number of slices").
            continue
        found.append(CiProfile(index, profile_id, int(raw.instanceCount), int(raw.sliceCount)))
    found.sort(key=lambda c: -c.slices)
    return found


def list_compute_instances(nvml: Any, gpu: int, gi: Any, ci_profile: CiProfile) -> list[Any]:
    """The compute instance handles of one profile in the GPU instance ``gi``."""
    count = ctypes.c_uint(0)
    array = (nvml.c_nvmlComputeInstance_t * max(ci_profile.instance_count, 1))()
    with nvml_errors("list compute instances", gpu=gpu):
        nvml.nvmlGpuInstanceGetComputeInstances(
            gi, ci_profile.profile_id, array, ctypes.byref(count)
        )
    return [array[i] for i in range(count.value)]


def ci_index_for(nvml: Any, compute_slices: int) -> int:
    """The ``NVML_COMPUTE_INSTANCE_PROFILE_*`` index of a full compute instance."""
    index = getattr(nvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{compute_slices}_SLICE", None)
    if index is None:
        raise GpuUnsupported(
            f"NVML has no compute instance profile with {compute_slices} slices",
            hint="upgrade nvidia-ml-py and the driver",
        )
    return int(index)


# -- create and destroy -----------------------------------------------------------------------


def create_gpu_instance(
    nvml: Any, handle: Any, gpu: int, profile: Profile, start: int, mig_mode: MigModeReader
) -> Any:
    """``nvmlDeviceCreateGpuInstanceWithPlacement`` of ``profile`` at ``start``.

    Raises:
        InvalidStart: ``start`` is not a placement of the profile (with the legal ones).
        InsufficientResources: NVML refuses a legal start (see :func:`explain_refusal`).
    """
    placement = nvml.c_nvmlGpuInstancePlacement_t()
    placement.start = start
    placement.size = profile.memory_slices
    op = f"create {profile.name} at unit {start}"
    try:
        with nvml_errors(
            op,
            gpu=gpu,
            profile=profile.name,
            start=start,
            mig_mode=mig_mode,
            invalid_argument=(InsufficientResources if start in profile.starts else InvalidStart),
        ):
            # byref: NVML takes a pointer and pynvml passes the argument through as is
            # (reference §5.1/§5.2); a by-value struct crashes the process.
            return nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                handle, profile.profile_id, ctypes.byref(placement)
            )
    except InvalidStart as err:
        raise InvalidStart(
            f"{profile.name} cannot start at unit {start} on GPU {gpu} ({err.message})",
            hint=f"legal starts of {profile.name}: " + ", ".join(map(str, profile.starts)),
            **err.details,
        ) from err.__cause__


def explain_refusal(
    gpu: int,
    geometry: Geometry,
    profile: Profile,
    start: int,
    err: InsufficientResources,
    instances: Callable[[], list[MigInstance]],
) -> InsufficientResources:
    """NVML only says INSUFFICIENT_RESOURCES; say which rule (overlap, limit, cap) applies.

    ``instances`` lists the GPU's instances now (the boundary's ``list_instances``).
    """
    from migd.core.states import state_space

    hint: str | None = None
    try:
        existing = [(m.profile_id, m.start) for m in instances()]
        space = state_space(geometry, "all")
        key = space.key_of(existing)
        space.allocate(key, profile.profile_id, start)
    except PlacementOverlap as why:
        reason = why.message
    except IllegalTransition as why:  # instance limit or a shared engine (e.g. one OFA)
        reason = why.message
        hint = "release an instance of the same kind, or use another profile"
    except MigdError as other:  # cannot look: keep NVML's word
        reason = f"the current layout could not be read ({other.message})"
    else:
        reason = (
            "migd's placement table allows it, so another NVML client changed the "
            "GPU or the table is wrong for this driver"
        )
    return InsufficientResources(
        f"cannot create {profile.name} at unit {start} on GPU {gpu}: {reason}",
        hint=hint,
        **err.details,
    )


def roll_back(nvml: Any, gpu: int, gi: Any, ci: Any) -> None:
    """Undo a half-made instance; log (never raise) if that fails too."""
    try:
        if ci is not None:
            nvml.nvmlComputeInstanceDestroy(ci)
        nvml.nvmlGpuInstanceDestroy(gi)
    except Exception as exc:
        _log.error(
            "GPU %d: could not remove a half-created GPU instance (%s); it stays "
            "until destroyed by hand (`nvidia-smi mig -dgi`)",
            gpu,
            exc,
        )
