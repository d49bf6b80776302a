"""MIG device handles resolved by GPU instance and compute instance ids, and their cache.

A MIG device's UUID and handle are found through the parent's MIG device handles
(:func:`walk_mig_devices`: ``nvmlDeviceGetMaxMigDeviceCount`` +
``nvmlDeviceGetMigDeviceHandleByIndex``, NOT_FOUND being an empty slot), matched by
``nvmlDeviceGetGpuInstanceId`` / ``nvmlDeviceGetComputeInstanceId``.
``nvmlComputeInstanceInfo_t.device`` is documented in ``nvml.h`` as the *parent*
device, so its UUID is the GPU's; it is used only after ``nvmlDeviceIsMigDeviceHandle``
and the ids confirm that a driver put the MIG device there
(:func:`confirmed_mig_device`; docs/nvml.md).

:class:`MigDevices` remembers what was last seen per GPU; a remembered handle is used
only while NVML still gives it the same UUID (handles get reused).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from migd.backends.nvml.discovery import text
from migd.backends.nvml.errors import is_library_mismatch, nvml_error_code, nvml_errors
from migd.backends.nvml_codes import NVML_ERROR_INVALID_ARGUMENT, NVML_ERROR_NOT_FOUND
from migd.errors import GpuNotFound

# A MIG device handle index with nothing behind it (nvml.h: NOT_FOUND "if no valid MIG
# device was found at index"; INVALID_ARGUMENT past the end, or for a handle that went
# stale while being read, as the Kubernetes DRA driver also treats it).
_EMPTY_SLOT = frozenset({NVML_ERROR_NOT_FOUND, NVML_ERROR_INVALID_ARGUMENT})

MigIds = tuple[int, int]  # (GPU instance id, compute instance id)

# (MIG UUID, MIG device handle) of one compute instance.
MigDevice = tuple[str, Any]


class MigDevices:
    """The MIG devices of each GPU, (GI id, CI id) -> (MIG UUID, handle), as last seen.

    Args:
        nvml: gives the initialised pynvml module (the boundary's session).
        parent: gives the handle of GPU ``gpu``.
    """

    def __init__(self, nvml: Callable[[], Any], parent: Callable[[int], Any]) -> None:
        self._nvml = nvml
        self._parent = parent
        # Per GPU: (GI id, CI id) -> (MIG UUID, the MIG device handle last seen for it).
        self._seen: dict[int, dict[MigIds, MigDevice]] = {}

    def walk(self, gpu: int) -> dict[MigIds, MigDevice]:
        """Every MIG device of the GPU, from NVML (see :func:`walk_mig_devices`); remembered."""
        found = walk_mig_devices(self._nvml(), self._parent(gpu), gpu)
        self._seen[gpu] = found
        return found

    def known(self, gpu: int) -> dict[MigIds, MigDevice]:
        """The MIG devices as last seen, unchecked (for naming, not for calls)."""
        return self._seen.get(gpu, {})

    def remember(self, gpu: int, devices: dict[MigIds, MigDevice]) -> None:
        """Remember exactly ``devices`` for the GPU (what a listing found)."""
        self._seen[gpu] = devices

    def add(self, gpu: int, ids: MigIds, device: MigDevice) -> None:
        """Remember one MIG device (one just made)."""
        self._seen.setdefault(gpu, {})[ids] = device

    def forget_gpu_instance(self, gpu: int, gi_id: int) -> None:
        """Forget the MIG devices of a destroyed GPU instance."""
        seen = self._seen.get(gpu, {})
        for ids in [ids for ids in seen if ids[0] == gi_id]:
            del seen[ids]

    def cached(self, gpu: int, ids: MigIds) -> MigDevice | None:
        """The MIG device of compute instance ``ids`` as last seen, if NVML still gives its
        handle the same UUID (a MIG UUID belongs to one compute instance for life)."""
        cached = self._seen.get(gpu, {}).get(ids)
        if cached is not None and handle_has_uuid(self._nvml(), gpu, cached[1], cached[0]):
            return cached
        return None

    def find(self, gpu: int, ids: MigIds) -> MigDevice | None:
        """The MIG device of compute instance ``ids``: cached, else by walking the slots."""
        return self.cached(gpu, ids) or self.walk(gpu).get(ids)

    def handle_of(self, gpu: int, mig_uuid: str) -> Any:
        """The MIG device handle of ``mig_uuid``: the last one seen if NVML still gives it
        that UUID (handles may be reused for another device), else from a fresh walk.

        Raises:
            GpuNotFound: no MIG device with that UUID on this GPU.
        """
        handle = dict(self._seen.get(gpu, {}).values()).get(mig_uuid)
        if handle is not None and handle_has_uuid(self._nvml(), gpu, handle, mig_uuid):
            return handle
        devices = dict(self.walk(gpu).values())
        if mig_uuid not in devices:
            _no_mig_device(gpu, mig_uuid)
        return devices[mig_uuid]


def _no_mig_device(gpu: int, mig_uuid: str, cause: BaseException | None = None) -> NoReturn:
    raise GpuNotFound(
        f"there is no MIG device {mig_uuid} on GPU {gpu}",
        hint="the instance was destroyed or re-created (MIG UUIDs change then); "
        "`migctl status` lists the current ones",
        gpu=gpu,
        mig_uuid=mig_uuid,
    ) from cause


def walk_mig_devices(nvml: Any, parent: Any, gpu: int) -> dict[MigIds, MigDevice]:
    """Every MIG device of the GPU: (GI id, CI id) -> (MIG UUID, MIG device handle).

    Walks ``nvmlDeviceGetMigDeviceHandleByIndex`` over ``nvmlDeviceGetMaxMigDeviceCount``
    slots (an empty slot answers NOT_FOUND).
    """
    with nvml_errors("count MIG devices", gpu=gpu):
        slots = int(nvml.nvmlDeviceGetMaxMigDeviceCount(parent))
    found: dict[MigIds, MigDevice] = {}
    for index in range(slots):
        with nvml_errors("read MIG device", gpu=gpu, mig_index=index):
            try:
                device = nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, index)
                ids = (
                    int(nvml.nvmlDeviceGetGpuInstanceId(device)),
                    int(nvml.nvmlDeviceGetComputeInstanceId(device)),
                )
                uuid = text(nvml.nvmlDeviceGetUUID(device))
            except Exception as exc:
                if nvml_error_code(exc) in _EMPTY_SLOT:
                    continue  # no MIG device here (or it just went away)
                raise
        found[ids] = (uuid, device)
    return found


def handle_has_uuid(nvml: Any, gpu: int, handle: Any, uuid: str) -> bool:
    """Whether a MIG device handle seen before still names ``uuid`` (handles get reused)."""
    with nvml_errors("open MIG device", gpu=gpu, mig_uuid=uuid):
        try:
            return text(nvml.nvmlDeviceGetUUID(handle)) == uuid
        except Exception as exc:
            if nvml_error_code(exc) in _EMPTY_SLOT:
                return False  # a stale handle
            raise


def confirmed_mig_device(nvml: Any, ids: MigIds, ci_device: Any) -> MigDevice | None:
    """``nvmlComputeInstanceInfo_t.device`` of compute instance ``ids``, if it is its MIG device.

    nvml.h documents that field as the parent GPU, whose UUID is the GPU's. It is used
    only where NVML confirms it is this MIG device (some drivers fill it in so); ``None``
    tells the caller to walk the MIG devices instead.
    """
    try:
        is_mig = nvml.nvmlDeviceIsMigDeviceHandle(ci_device)
        if (
            int(getattr(is_mig, "value", is_mig))
            and (
                int(nvml.nvmlDeviceGetGpuInstanceId(ci_device)),
                int(nvml.nvmlDeviceGetComputeInstanceId(ci_device)),
            )
            == ids
        ):
            uuid = text(nvml.nvmlDeviceGetUUID(ci_device))
            if uuid.startswith("MIG-"):
                return uuid, ci_device
    except Exception as exc:
        if nvml_error_code(exc) is None and not is_library_mismatch(exc):
            raise  # not NVML saying no: a bug
    return None
