"""MIG operations on the simulated node: GPU and compute instances, and the driver's rules.

:class:`MigOps` (``node.mig``) creates and destroys GPU and compute instances with NVML's
argument conventions (:class:`~migd.backends.simulated.fake_pynvml.FakePynvml` calls it),
refuses what the driver refuses, and resolves instance handles. It keeps the MIG handle
tables (by serial and by MIG UUID) and the MIG UUID generator; the GPUs themselves are the
node's (:attr:`SimNode.gpus <migd.backends.simulated.node.SimNode.gpus>`).

Placement legality is implemented here from the geometry's *data* (legal starts,
placement sizes, per-profile instance limits, exclusive groups, engine budget),
with its own plain unit-set arithmetic, and deliberately without
:mod:`migd.core.states`: tests compare the two, so each checks the other.

Errors NVML would return are raised as :class:`~migd.backends.simulated.nvml_api.NVMLError`
with the code real NVML documents (``nvml.h`` of NVIDIA/go-nvml ``2f9e261``, cited
at each raise).
"""

from __future__ import annotations

import contextlib
import random
import threading
import uuid as uuid_module
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from migd.backends.simulated import nvml_api as api
from migd.backends.simulated.state import SimComputeInstance, SimGpu, SimGpuInstance
from migd.core.costs import CostModel
from migd.core.geometry import Geometry, Profile

if TYPE_CHECKING:
    from migd.backends.simulated.node import SimNode

# NVML_COMPUTE_INSTANCE_PROFILE_* index -> compute slices (nvml.h). 0x7 is
# COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1: a second 1-slice entry, which NVIDIA's DRA driver
# skips because it has "the same number of slices" as 1_SLICE (k8s-dra-driver-gpu,
# cmd/gpu-kubelet-plugin/nvlib.go, inspectMigProfilesAndPlacements). The simulator reports
# it under the plain 1-slice profile's id (REV1_REPORTED_ID), the case in which a reader
# that does not de-duplicate lists every 1-slice CI twice (docs/nvml.md). 7_SLICE_NVL
# (0x8) is not offered.
CI_PROFILE_1_SLICE_REV1 = 0x7
CI_PROFILE_SLICES: dict[int, int] = {
    0x0: 1,
    0x1: 2,
    0x2: 3,
    0x3: 4,
    0x4: 7,
    0x5: 8,
    0x6: 6,
    CI_PROFILE_1_SLICE_REV1: 1,
}
#: The profile id ``nvmlGpuInstanceGetComputeInstanceProfileInfo`` reports for REV1.
REV1_REPORTED_ID = 0x0


class MigOps:
    """The MIG half of a :class:`~migd.backends.simulated.node.SimNode` (``node.mig``).

    The NVML-facing methods take the node lock; MIG changes of one GPU are serialised as
    the driver serialises them, and their latency is waited out without the lock. The
    building blocks the node and :mod:`~migd.backends.simulated.persist` share
    (:meth:`refusal`, :meth:`add_gi`, :meth:`add_ci`, the lookups) expect the caller to
    hold the lock.
    """

    def __init__(self, node: SimNode) -> None:
        self.node = node
        self._lock = node.lock
        self._write_done = threading.Condition(self._lock)
        self._writing_gpus: set[int] = set()  # GPUs with a MIG change in progress
        self._costs = [
            CostModel(dict(s.latency)) if s.latency else CostModel.for_model(s.model or "H100")
            for s in node.specs
        ]
        self.serials = 0  # the last handle serial given out (never reused, not even by reset)
        self.clear()

    def clear(self) -> None:
        """Forget every instance handle and restart the MIG UUID generator (node reset)."""
        self.rng = random.Random(self.node.seed)
        self.gi_by_serial: dict[int, tuple[SimGpu, SimGpuInstance]] = {}
        self.ci_by_serial: dict[int, tuple[SimGpu, SimGpuInstance, SimComputeInstance]] = {}
        self.by_uuid: dict[str, tuple[SimGpu, SimGpuInstance, SimComputeInstance]] = {}

    # -- reads under the driver's rules ---------------------------------------------------------

    def can_create(self, index: int, profile_id: int, start: int) -> bool:
        """Whether the driver would accept ``profile_id`` at ``start`` on GPU ``index`` now.

        Answers from the simulator's own rules (not :mod:`migd.core.states`); tests compare
        the two on every state.
        """
        with self._lock:
            gpu = self.node.gpus[index]
            if gpu.geometry is None or not gpu.mig_current:
                return False
            profile = next((p for p in gpu.geometry.profiles if p.profile_id == profile_id), None)
            return (
                profile is not None
                and self.refusal(gpu, profile, start, profile.memory_slices) is None
            )

    def remaining_capacity(self, index: int, profile: Profile) -> int:
        """How many more instances of ``profile`` the driver would accept now, all together.

        Used for ``nvmlDeviceGetGpuInstanceRemainingCapacity``: instances are added at the
        profile's legal starts in order until the driver's rules refuse (the published
        placements are aligned, so first-fit packs as many as any order would).
        """
        with self._lock:
            gpu = self.node.gpus[index]
            added: list[SimGpuInstance] = []
            try:
                for start in profile.starts:
                    if self.refusal(gpu, profile, start, profile.memory_slices) is None:
                        # A placeholder the rules count; removed below, never persisted.
                        placeholder = SimGpuInstance(
                            -1 - len(added), -1 - len(added), profile, start
                        )
                        gpu.instances[placeholder.gi_id] = placeholder
                        added.append(placeholder)
            finally:
                for placeholder in added:
                    del gpu.instances[placeholder.gi_id]
            return len(added)

    def mig_devices(self, index: int) -> dict[int, tuple[SimGpuInstance, SimComputeInstance]]:
        """GPU ``index``'s MIG devices by their index under the parent (holes are empty slots)."""
        with self._lock:
            return {
                ci.mig_index: (gi, ci)
                for gi in self.node.gpus[index].instances.values()
                for ci in gi.cis.values()
            }

    def mig_device_at(
        self, index: int, mig_index: int
    ) -> tuple[SimGpuInstance, SimComputeInstance] | None:
        """The MIG device in slot ``mig_index`` as ``nvmlDeviceGetMigDeviceHandleByIndex``
        sees it: ``None`` for an empty slot, and for a new device whose handle has not
        appeared yet (each such lookup counts down ``mig_handle_delay``)."""
        with self._lock:
            found = self.mig_devices(index).get(mig_index)
            if found is not None and found[1].hidden_lookups > 0:
                found[1].hidden_lookups -= 1
                return None
            return found

    def max_mig_devices(self, index: int) -> int:
        """``nvmlDeviceGetMaxMigDeviceCount``: one per compute slice at most; 0 without MIG."""
        gpu = self.node.gpus[index]
        if gpu.geometry is None or not gpu.mig_current:
            return 0
        return gpu.geometry.compute_slices

    # -- MIG operations (called by FakePynvml with the NVML argument conventions) -------------

    def require_mig(self, gpu: SimGpu) -> Geometry:
        """The GPU's geometry if MIG is enabled now, else NVML's NOT_SUPPORTED."""
        if gpu.geometry is None or not gpu.mig_current:
            # nvml.h: instance calls return NVML_ERROR_NOT_SUPPORTED "If device doesn't have
            # MIG mode enabled" (and for GPUs without MIG).
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)
        return gpu.geometry

    def create_gpu_instance(
        self, index: int, profile_id: int, start: int, size: int
    ) -> SimGpuInstance:
        """``nvmlDeviceCreateGpuInstanceWithPlacement`` semantics.

        Raises:
            NVMLError: NOT_SUPPORTED (MIG off), INVALID_ARGUMENT (unknown profile, illegal
                start or size), INSUFFICIENT_RESOURCES (overlap, instance limit, shared cap).
        """
        with self._writing(index):
            with self._lock:
                gpu = self.node.gpus[index]
                geometry = self.require_mig(gpu)
                profile = next((p for p in geometry.profiles if p.profile_id == profile_id), None)
                if profile is None:
                    # nvml.h: INVALID_ARGUMENT "If device, profile, profileId, placement or
                    # gpuInstance are invalid".
                    raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
                refusal = self.refusal(gpu, profile, start, size)
                if refusal is not None:
                    raise api.NVMLError(refusal)
            self.node.pause(self._costs[index].create_s(profile.compute_slices))
            with self._lock:
                # Only this GPU's MIG writes are held off; check again what they cannot see.
                refusal = self.refusal(gpu, profile, start, size) if gpu.mig_current else None
                if not gpu.mig_current or refusal is not None:
                    raise api.NVMLError(refusal or api.NVML_ERROR_NOT_SUPPORTED)
                gi = self.add_gi(gpu, profile, start)
                self.node.save()
                return gi

    def refusal(self, gpu: SimGpu, profile: Profile, start: int, size: int) -> int | None:
        """Why the driver refuses ``profile`` at ``start`` now (an NVML code), or None."""
        if start not in profile.starts or size != profile.memory_slices:
            # nvml.h: INVALID_ARGUMENT if the placement is invalid.
            return api.NVML_ERROR_INVALID_ARGUMENT
        wanted = set(range(start, start + size))
        existing = list(gpu.instances.values())
        taken: set[int] = set()
        for gi in existing:
            taken |= gi.units
        if wanted & taken:
            # NVML_ERROR_INSUFFICIENT_RESOURCES "If the requested GPU instance could not be
            # created"; placement collisions report it too (NVIDIA/k8s-dra-driver-gpu
            # cmd/gpu-kubelet-plugin/nvlib.go, reference §5.3), not "already exists".
            return api.NVML_ERROR_INSUFFICIENT_RESOURCES
        if sum(gi.profile.profile_id == profile.profile_id for gi in existing) >= (
            profile.max_instances
        ):
            return api.NVML_ERROR_INSUFFICIENT_RESOURCES
        geometry = gpu.geometry
        assert geometry is not None
        for group in geometry.exclusive_groups:
            if profile.profile_id in group.profile_ids:
                members = sum(gi.profile.profile_id in group.profile_ids for gi in existing)
                if members + 1 > group.max_instances:
                    return api.NVML_ERROR_INSUFFICIENT_RESOURCES
        budget = geometry.engine_budget
        if budget and profile.engines is not None:
            for engine, cap in budget.items():
                used = sum((gi.profile.engines or {}).get(engine, 0) for gi in existing)
                if used + profile.engines.get(engine, 0) > cap:
                    return api.NVML_ERROR_INSUFFICIENT_RESOURCES
        return None

    def add_gi(
        self, gpu: SimGpu, profile: Profile, start: int, gi_id: int | None = None
    ) -> SimGpuInstance:
        """Add a GPU instance the rules allow (checked by the caller), at its driver id."""
        geometry = gpu.geometry
        assert geometry is not None
        if gi_id is None:
            gi_id = placement_gi_id(geometry.units, profile.memory_slices, start)
            if gi_id in gpu.instances:  # a geometry the rule does not fit: any free id
                gi_id = _lowest_free(gpu.instances, 1)
        self.serials += 1
        gi = SimGpuInstance(self.serials, gi_id, profile, start)
        gpu.instances[gi_id] = gi
        self.gi_by_serial[gi.serial] = (gpu, gi)
        return gi

    def destroy_gpu_instance(self, gi_serial: int) -> None:
        """``nvmlGpuInstanceDestroy``: IN_USE while compute instances exist.

        Raises:
            NVMLError: INVALID_ARGUMENT (stale handle), IN_USE.
        """
        with self._lock:
            gpu, _gi = self.lookup_gi(gi_serial)
        with self._writing(gpu.index):
            with self._lock:
                gpu, gi = self.lookup_gi(gi_serial)  # it may have gone while we waited
                self.require_mig(gpu)
                if gi.cis:
                    # nvml.h: IN_USE "if processes (e.g. CUDA application) or compute
                    # instances are active on the GPU instance".
                    raise api.NVMLError(api.NVML_ERROR_IN_USE)
            self.node.pause(self._costs[gpu.index].destroy_s(gi.profile.compute_slices))
            with self._lock:
                if self.gi_by_serial.get(gi.serial) is None:  # reset() meanwhile
                    raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
                del gpu.instances[gi.gi_id]
                del self.gi_by_serial[gi.serial]
                self.node.save()

    def lookup_gi(self, gi_serial: int) -> tuple[SimGpu, SimGpuInstance]:
        """A live GPU instance by handle serial (INVALID_ARGUMENT for a stale handle)."""
        found = self.gi_by_serial.get(gi_serial)
        if found is None:
            # nvml.h: INVALID_ARGUMENT "If gpuInstance is invalid" (destroyed: handle invalid).
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
        return found

    def lookup_ci(self, ci_serial: int) -> tuple[SimGpu, SimGpuInstance, SimComputeInstance]:
        """A live compute instance by handle serial (INVALID_ARGUMENT for a stale handle)."""
        found = self.ci_by_serial.get(ci_serial)
        if found is None:
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
        return found

    def ci_profile(self, gi: SimGpuInstance, profile_index: int) -> tuple[int, int]:
        """(slices, instance count) of CI profile ``profile_index`` inside ``gi``.

        Raises:
            NVMLError: INVALID_ARGUMENT past the enum, NOT_SUPPORTED where the GI
                cannot host it (nvml.h: "If profile isn't supported").
        """
        if not 0 <= profile_index < api.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
        slices = CI_PROFILE_SLICES.get(profile_index)
        gi_slices = gi.profile.compute_slices
        if slices is None or slices > gi_slices or (slices > 4 and slices != gi_slices):
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)
        return slices, gi_slices // slices

    def create_compute_instance(self, gi_serial: int, profile_index: int) -> SimComputeInstance:
        """``nvmlGpuInstanceCreateComputeInstance`` (profile ID == CI profile index here).

        Raises:
            NVMLError: NOT_SUPPORTED, INSUFFICIENT_RESOURCES (compute slices used up).
        """
        with self._lock:
            gpu, _gi = self.lookup_gi(gi_serial)
        with self._writing(gpu.index), self._lock:
            gpu, gi = self.lookup_gi(gi_serial)
            slices, _count = self.ci_profile(gi, profile_index)
            if sum(ci.slices for ci in gi.cis.values()) + slices > gi.profile.compute_slices:
                raise api.NVMLError(api.NVML_ERROR_INSUFFICIENT_RESOURCES)
            ci = self.add_ci(gpu, gi, profile_index)
            self.node.save()
            return ci

    def add_ci(
        self,
        gpu: SimGpu,
        gi: SimGpuInstance,
        profile_index: int,
        uuid: str | None = None,
        ci_id: int | None = None,
    ) -> SimComputeInstance:
        """Add a compute instance (slices checked by the caller); a new MIG UUID unless given."""
        self.serials += 1
        taken = {c.mig_index: c for g in gpu.instances.values() for c in g.cis.values()}
        ci = SimComputeInstance(
            serial=self.serials,
            ci_id=_lowest_free(gi.cis, 0) if ci_id is None else ci_id,
            profile_index=profile_index,
            slices=CI_PROFILE_SLICES[profile_index],
            uuid=uuid or f"MIG-{uuid_module.UUID(int=self.rng.getrandbits(128), version=4)}",
            mig_index=_lowest_free(taken, 0),
            hidden_lookups=self.node.mig_handle_delay if uuid is None else 0,
        )
        gi.cis[ci.ci_id] = ci
        self.ci_by_serial[ci.serial] = (gpu, gi, ci)
        self.by_uuid[ci.uuid] = (gpu, gi, ci)
        return ci

    def destroy_compute_instance(self, ci_serial: int) -> None:
        """``nvmlComputeInstanceDestroy``: IN_USE while a process uses the MIG device.

        Raises:
            NVMLError: INVALID_ARGUMENT (stale handle), IN_USE.
        """
        with self._lock:
            gpu, _gi, _ci = self.lookup_ci(ci_serial)
        with self._writing(gpu.index), self._lock:
            _gpu, gi, ci = self.lookup_ci(ci_serial)
            self.node.procs.drop_dead()
            if any(p.ci_serial == ci.serial for p in self.node.procs.by_pid.values()):
                # nvml.h: IN_USE "if processes (e.g. CUDA application) are active on the
                # compute instance".
                raise api.NVMLError(api.NVML_ERROR_IN_USE)
            del gi.cis[ci.ci_id]
            del self.ci_by_serial[ci.serial]
            del self.by_uuid[ci.uuid]
            self.node.save()

    @contextlib.contextmanager
    def _writing(self, index: int) -> Iterator[None]:
        """Hold off other MIG changes of GPU ``index`` (the driver serialises them).

        Only writers of the same GPU wait; reads of every GPU, and writes of the others,
        go on, as NVML's do while an instance is being created.
        """
        with self._write_done:
            while index in self._writing_gpus:
                self._write_done.wait()  # releases the node lock while waiting
            self._writing_gpus.add(index)
        try:
            yield
        finally:
            with self._write_done:
                self._writing_gpus.discard(index)
                self._write_done.notify_all()


def placement_gi_id(units: int, memory_slices: int, start: int) -> int:
    """The GPU instance id the driver gives an instance at ``start``.

    Real GPUs number instances by placement, not by order of creation: the memory slices
    form a binary tree (the whole GPU at the root, id 0; halves 1-2; quarters 3-6; single
    slices 7-14 on an 8-slice GPU), and an instance gets the id of the smallest node that
    covers it. NVIDIA's MIG user guide ("Example 1: Creation of a 4-2-1 geometry",
    A100-40GB) gets id 1 for 4g.20gb at 0, 5 for 2g.10gb at 4 and 13 for 1g.5gb at 6;
    a published H100 ``nvidia-smi mig -lgi`` lists 1g.10gb at starts 0-6 as ids 7-13.
    That the rule holds for every profile and model is inference;
    ``scripts/mig_calibrate.py`` records the ids per placement to settle it.
    """
    span = 1
    while span < memory_slices:
        span *= 2
    leaves = 1
    while leaves < units:
        leaves *= 2
    return leaves // span - 1 + start // span


def _lowest_free(used: dict[int, Any], first: int) -> int:
    candidate = first
    while candidate in used:
        candidate += 1
    return candidate


__all__ = ["CI_PROFILE_1_SLICE_REV1", "CI_PROFILE_SLICES", "REV1_REPORTED_ID", "MigOps"]
