"""Mode drivers: what the scheduler does differently for a GPU in each mode.

:class:`NodeScheduler` keeps the queue, the lease table, the transition table and
its outcomes; for anything that depends on a GPU's mode it asks that mode's driver
(:class:`GpuModeOps`), picked once by ``gpu.mode``:

* :class:`~migd.core.mig_mode.MigOps` - MIG instances planned by :mod:`migd.core.planner`,
  and MPS shares inside MIG instances (:class:`migd.core.mig_mode.MpsHosts`);
* :class:`MpsOps` - one MPS pool for the whole GPU;
* :class:`ExclusiveOps` - the whole GPU to one lease;
* :class:`OffOps` - a GPU migd does not manage (never a candidate).

A driver owns no state: the books are the GPU's mode state (:mod:`migd.core.gpus`)
and the scheduler's leases, reached through :class:`ModeBooks`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from migd.core.demand import DemandModel
from migd.core.geometry import Profile
from migd.core.gpus import (
    GpuMode,
    ManagedGpu,
    ManagedInstance,
    MpsState,
    RequestMode,
    Work,
)
from migd.core.leases import Lease, LeaseEvent, LeaseRequest
from migd.core.mps import MpsPool, MpsRequest, UserPolicy, can_admit, clear_waiting, mark_waiting
from migd.core.mps import admit as mps_admit
from migd.core.mps import release as mps_release
from migd.core.planner import (
    Op,
    PartitionRequest,
    Sizing,
)
from migd.core.policy import SchedulerPolicy
from migd.core.queueing import QueuedRequest
from migd.core.states import StateSpace
from migd.errors import RequestTooLarge

#: Compute slices of a GPU without a MIG geometry, for reading ``min_compute`` as an MPS
#: thread percentage: sevenths, the slice of A100/H100-class GPUs.
DEFAULT_COMPUTE_SLICES = 7

#: ``created`` of :meth:`GpuModeOps.work_done`: start -> (gi_id, mig_uuid, memory_mib).
Created = Mapping[int, tuple[int | None, str | None, int]]


class ModeBooks(Protocol):
    """What a mode driver reads and changes in the scheduler (:class:`NodeScheduler`)."""

    @property
    def policy(self) -> SchedulerPolicy: ...
    @property
    def gpus(self) -> Mapping[int, ManagedGpu]: ...
    @property
    def leases(self) -> Mapping[str, Lease]: ...
    @property
    def demand(self) -> DemandModel: ...
    def queued(self) -> Iterable[QueuedRequest[str]]: ...
    def transition(self, lease: Lease, event: LeaseEvent, now_s: float, reason: str = "") -> None:
        """A lease's state change, through the transition table and into the outcome."""
        ...

    def new_work(self, gpu: int, lease_id: str | None, ops: tuple[Op, ...] = ()) -> Work:
        """Work for the caller (NVML operations pending until done; none: a plain grant)."""
        ...

    def teardown(self, gpu: ManagedGpu, instances: Sequence[ManagedInstance]) -> list[Work]:
        """Destroy idle instances (the work is pending until done)."""
        ...

    def mps_env(self, gpu: ManagedGpu, lease: Lease) -> dict[str, str]:
        """The job environment of an MPS share."""
        ...


@dataclass(frozen=True)
class Fit:
    """Whether a request could ever fit one GPU (empty), for ``check_ever_fits``."""

    fits: bool = False
    # The most memory this GPU could give one lease, and why not, in words: for MPS and
    # whole GPUs (a MIG instance's sizing says both for the planner).
    largest_mib: int = 0
    why: str = ""
    sizing: tuple[StateSpace, Sizing] | None = None  # MIG: why no profile fits
    demand: tuple[str, Profile] | None = None  # MIG: (model, the profile it sizes to)


@dataclass(frozen=True)
class Holding:
    """What a granted lease holds on its GPU, for callers that account for its use (the
    policy simulator): a MIG instance (``profile`` at ``start``) or the whole GPU
    (``profile`` None); ``shared``: an MPS share of it rather than all of it."""

    profile: Profile | None = None
    start: int = 0
    shared: bool = False


class GpuModeOps(Protocol):
    """One GPU mode's behaviour; see the module docstring."""

    mode: GpuMode

    def serves(self, gpu: ManagedGpu, request_mode: RequestMode) -> bool:
        """Whether a request for ``request_mode`` may use this GPU at all."""
        ...

    def admits_by_uid(self, gpu: ManagedGpu) -> bool:
        """Whether admission here depends on the requester's uid (MPS serves one user)."""
        ...

    def ever_fits(self, gpu: ManagedGpu, request: LeaseRequest) -> Fit:
        """Whether the request could fit the GPU when nothing else runs."""
        ...

    def shape(self, gpu: ManagedGpu, request: LeaseRequest) -> tuple[Hashable, Hashable] | None:
        """(key, value) this GPU adds to a request's placement shape (see the scheduler's
        ``_placement_shape``); None: the GPU does not distinguish requests."""
        ...

    def clear_waiting(self, gpu: ManagedGpu) -> None:
        """Drop MPS marks of users waiting for a device (each pass sets them again)."""
        ...

    def place(self, lease: Lease, gpus: Sequence[ManagedGpu], now_s: float) -> Work | None:
        """Place ``lease`` on one of ``gpus`` (all in this mode, in preference order) and
        commit it to the books, or return None."""
        ...

    def release(self, gpu: ManagedGpu, lease: Lease, now_s: float) -> list[Work]:
        """Give back what ``lease`` held on the GPU; the work: teardown the policy wants."""
        ...

    def restore(self, gpu: ManagedGpu, lease: Lease) -> str:
        """Bind a lease from the state db to its instance, share or GPU again; a reason
        when what it held is gone (it is reclaimed), else ``""``."""
        ...

    def work_done(self, gpu: ManagedGpu, work: Work, created: Created, now_s: float) -> None:
        """Record finished NVML work (only MIG GPUs get any) and activate its leases."""
        ...

    def why_not(self, gpu: ManagedGpu) -> dict[str, Any]:
        """Why a request does not fit the GPU now, for its refusal and ``migctl explain``."""
        ...

    # -- what status and metrics show (the caller checks ``gpu.available`` first) --

    def largest_placeable(self, gpu: ManagedGpu) -> tuple[str, int] | None:
        """The biggest partition one new job could get now: (profile, or ``mps`` /
        ``whole-gpu``, MiB); None when nothing fits."""
        ...

    def placeable_mib(self, gpu: ManagedGpu) -> int:
        """GPU memory new leases could still get here, in total (HTCondor's free memory)."""
        ...

    def allocated_mib(self, gpu: ManagedGpu) -> int:
        """GPU memory promised to leases (not what they use)."""
        ...

    # -- what a caller accounting for leases' use asks (the policy simulator) --

    def holding(self, gpu: ManagedGpu, lease: Lease) -> Holding:
        """What ``lease``, granted on this GPU, holds."""
        ...

    def restart_room(self, gpu: ManagedGpu, holding: Holding) -> tuple[tuple[int, ...], int]:
        """Where a job that outgrew ``holding`` may restart here (the wrapper's rule,
        :func:`migd.core.restart.restart_size`): the partition sizes it climbs (empty:
        none, its limit grows) and the most MiB it may ask for."""
        ...

    def layout_key(self, gpu: ManagedGpu) -> Hashable | None:
        """What ``largest_placeable`` and ``slice_usage`` depend on, for callers that
        memoise them; None: nothing worth memoising (cheap to compute)."""
        ...

    def slice_usage(self, gpu: ManagedGpu) -> tuple[int, int]:
        """(compute slices its instances hold, compute + memory slices its layout wastes,
        [Turkkan]); (0, 0) without instances."""
        ...


def mps_thread_percentage(request: LeaseRequest, compute_slices: int | None) -> int | None:
    """The ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` of an MPS share.

    An explicit ``mps_thread_percentage`` wins. Else ``min_compute`` (compute slices,
    as for MIG) becomes its share of the device's slices, rounded up: 2 of a 7-slice
    GPU is 29 %, 1 of a 3-slice instance 34 %. A device without a slice count (a GPU
    model without MIG) counts sevenths, the slice of A100/H100-class GPUs. MPS takes
    the value as a cap on the SMs the client's work may occupy, not a reservation
    (docs.nvidia.com/deploy/mps, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE). ``None``: no cap.
    """
    if request.mps_thread_percentage is not None:
        return request.mps_thread_percentage
    if request.min_compute <= 0:
        return None
    slices = compute_slices or DEFAULT_COMPUTE_SLICES
    return min(100, math.ceil(100 * request.min_compute / slices))


def mps_request(lease: Lease, compute_slices: int | None) -> MpsRequest:
    """The MPS share ``lease`` asks for on a device of ``compute_slices``."""
    request = lease.request
    return MpsRequest(
        lease.lease_id,
        lease.owner_uid,
        request.memory_mib,
        clients=request.mps_clients,
        thread_percentage=mps_thread_percentage(request, compute_slices),
    )


def restored_share(lease: Lease) -> MpsRequest:
    """The share an MPS lease from the state db held (its granted limit)."""
    return MpsRequest(
        lease.lease_id,
        lease.owner_uid,
        lease.memory_limit_mib or 1,
        clients=lease.request.mps_clients,
        thread_percentage=lease.mps_thread_percentage,
    )


def partition_request(request: LeaseRequest) -> PartitionRequest:
    return PartitionRequest(
        memory_mib=request.memory_mib,
        min_compute=request.min_compute,
        profile=request.profile,
    )


def grant(lease: Lease, gpu: ManagedGpu, mode: GpuMode) -> None:
    lease.gpu, lease.gpu_uuid, lease.mode = gpu.index, gpu.uuid, mode


def elsewhere(gpu: ManagedGpu, lease: Lease) -> str:
    """Why a restored lease granted in another mode than its GPU's now cannot stay."""
    if lease.mode is GpuMode.MIG or lease.mig_uuid:
        return "its MIG instance is gone"
    return f"its GPU runs in {gpu.mode.value} mode now"


class _WholeGpuOps:
    """What the two whole-GPU drivers share: a grant needs no NVML operation, so it is
    active at once, and a GPU that cannot take a lease is simply full or in use."""

    mode: GpuMode

    def __init__(self, books: ModeBooks) -> None:
        self.books = books

    def work_done(self, gpu: ManagedGpu, work: Work, created: Created, now_s: float) -> None:
        return  # the grant's work carries no NVML operation

    def why_not(self, gpu: ManagedGpu) -> dict[str, Any]:
        return {"gpu": gpu.index, "mode": gpu.mode.value, "why": "full or in use"}

    def layout_key(self, gpu: ManagedGpu) -> Hashable | None:
        return None

    def slice_usage(self, gpu: ManagedGpu) -> tuple[int, int]:
        return 0, 0


class MpsOps(_WholeGpuOps):
    """MPS: one pool for the whole GPU, shares admitted per user."""

    mode = GpuMode.MPS

    def pool(self, gpu: ManagedGpu) -> MpsPool:
        """The GPU's MPS accounting, created on first use from the policy."""
        state = gpu.mps
        assert state is not None, f"GPU {gpu.index} is not in MPS mode"
        if state.pool is None:
            policy = self.books.policy
            state.pool = MpsPool(
                device_uuid=gpu.uuid,
                memory_total_mib=gpu.memory_total_mib,
                reserve_mib=policy.mps_reserve_mib,
                max_clients=policy.mps_max_clients,
                policy=UserPolicy.MULTI_USER if policy.mps_multi_user else UserPolicy.PER_USER,
            )
        return state.pool

    def serves(self, gpu: ManagedGpu, request_mode: RequestMode) -> bool:
        return request_mode != "mig"

    def admits_by_uid(self, gpu: ManagedGpu) -> bool:
        return True

    def ever_fits(self, gpu: ManagedGpu, request: LeaseRequest) -> Fit:
        pool = self.pool(gpu)
        need_mib = request.memory_mib * request.mps_clients
        if need_mib <= pool.capacity_mib and request.mps_clients <= pool.max_clients:
            return Fit(fits=True, largest_mib=pool.capacity_mib)
        if request.mps_clients > pool.max_clients:
            why = (
                f"{request.mps_clients} MPS clients are more than GPU {gpu.index} "
                f"serves ({pool.max_clients})"
            )
        else:
            why = (
                f"{need_mib} MiB is more than GPU {gpu.index}'s MPS capacity "
                f"({pool.capacity_mib} MiB)"
            )
        return Fit(largest_mib=pool.capacity_mib, why=why)

    def shape(self, gpu: ManagedGpu, request: LeaseRequest) -> tuple[Hashable, Hashable] | None:
        return None  # MPS admission depends on the uid: such requests are never grouped

    def clear_waiting(self, gpu: ManagedGpu) -> None:
        pool = gpu.mps_pool
        if pool is not None and pool.draining_for_uid is not None:
            self._state(gpu).pool = clear_waiting(pool)

    def place(self, lease: Lease, gpus: Sequence[ManagedGpu], now_s: float) -> Work | None:
        for gpu in gpus:
            if gpu.available and self._admits(gpu, lease):
                return self._commit(lease, gpu, now_s)
        return None

    def _admits(self, gpu: ManagedGpu, lease: Lease) -> bool:
        pool = self.pool(gpu)
        try:
            answer = can_admit(pool, mps_request(lease, gpu.compute_slices))
        except RequestTooLarge:
            return False
        if not answer.ok and answer.waiting_for_uid is not None:
            # One MPS server serves one UID at a time: let the device drain for this user
            # so a stream of the current user's jobs cannot starve it.
            self._state(gpu).pool = mark_waiting(pool, lease.owner_uid)
        return answer.ok

    @staticmethod
    def _state(gpu: ManagedGpu) -> MpsState:
        assert gpu.mps is not None
        return gpu.mps

    def _commit(self, lease: Lease, gpu: ManagedGpu, now_s: float) -> Work:
        self.books.transition(lease, LeaseEvent.PLAN, now_s)
        share = mps_request(lease, gpu.compute_slices)
        pool = mps_admit(self.pool(gpu), share)
        self._state(gpu).pool = pool
        grant(lease, gpu, GpuMode.MPS)
        lease.memory_limit_mib = lease.request.memory_mib
        lease.mps_thread_percentage = share.thread_percentage
        lease.decision = {
            "action": "mps-share",
            "gpu": gpu.index,
            "pinned_mib": lease.request.memory_mib,
            "shares_after": len(pool.shares),
            "reason": f"GPU {gpu.index}: MPS share of {lease.request.memory_mib} MiB "
            f"({pool.free_mib} MiB left unpinned)",
        }
        lease.env = self.books.mps_env(gpu, lease)
        self.books.transition(lease, LeaseEvent.READY, now_s)
        lease.heartbeat_s = now_s
        return self.books.new_work(gpu.index, lease.lease_id)

    def release(self, gpu: ManagedGpu, lease: Lease, now_s: float) -> list[Work]:
        pool = gpu.mps_pool
        if pool is not None and pool.share(lease.lease_id) is not None:
            self._state(gpu).pool = mps_release(pool, lease.lease_id)
        return []

    def restore(self, gpu: ManagedGpu, lease: Lease) -> str:
        # It may overcommit: what ran before the restart runs on.
        if lease.mode is not GpuMode.MPS or lease.mig_uuid is not None:
            return elsewhere(gpu, lease)
        pool = self.pool(gpu)
        self._state(gpu).pool = replace(pool, shares=(*pool.shares, restored_share(lease)))
        return ""

    def largest_placeable(self, gpu: ManagedGpu) -> tuple[str, int] | None:
        pool = self.pool(gpu)
        if pool.clients >= pool.max_clients or pool.free_mib <= 0:
            return None
        return "mps", pool.free_mib

    def placeable_mib(self, gpu: ManagedGpu) -> int:
        pool = self.pool(gpu)
        return max(0, pool.free_mib) if pool.clients < pool.max_clients else 0

    def allocated_mib(self, gpu: ManagedGpu) -> int:
        pool = gpu.mps_pool
        return pool.used_mib if pool is not None else 0

    def holding(self, gpu: ManagedGpu, lease: Lease) -> Holding:
        return Holding(shared=True)

    def restart_room(self, gpu: ManagedGpu, holding: Holding) -> tuple[tuple[int, ...], int]:
        return (), gpu.memory_total_mib - self.books.policy.mps_reserve_mib


class ExclusiveOps(_WholeGpuOps):
    """EXCLUSIVE: the whole GPU to one lease, no MIG and no MPS."""

    mode = GpuMode.EXCLUSIVE

    def serves(self, gpu: ManagedGpu, request_mode: RequestMode) -> bool:
        return request_mode == "auto"

    def admits_by_uid(self, gpu: ManagedGpu) -> bool:
        return False

    def ever_fits(self, gpu: ManagedGpu, request: LeaseRequest) -> Fit:
        largest = gpu.memory_total_mib
        if request.memory_mib <= largest:
            return Fit(fits=True, largest_mib=largest)
        why = f"{request.memory_mib} MiB is more than GPU {gpu.index}'s {largest} MiB"
        return Fit(largest_mib=largest, why=why)

    def shape(self, gpu: ManagedGpu, request: LeaseRequest) -> tuple[Hashable, Hashable] | None:
        return (GpuMode.EXCLUSIVE,), request.memory_mib  # a whole GPU fits by MiB alone

    def clear_waiting(self, gpu: ManagedGpu) -> None:
        return

    def place(self, lease: Lease, gpus: Sequence[ManagedGpu], now_s: float) -> Work | None:
        for gpu in gpus:
            state = gpu.exclusive
            if (
                state is not None
                and gpu.available
                and state.lease_id is None
                and lease.request.memory_mib <= gpu.memory_total_mib
            ):
                self.books.transition(lease, LeaseEvent.PLAN, now_s)
                state.lease_id = lease.lease_id
                grant(lease, gpu, GpuMode.EXCLUSIVE)
                lease.memory_limit_mib = gpu.memory_total_mib
                lease.env = {"CUDA_VISIBLE_DEVICES": gpu.uuid, "NVIDIA_VISIBLE_DEVICES": gpu.uuid}
                lease.decision = {"action": "exclusive", "gpu": gpu.index, "reason": "whole GPU"}
                self.books.transition(lease, LeaseEvent.READY, now_s)
                lease.heartbeat_s = now_s
                return self.books.new_work(gpu.index, lease.lease_id)
        return None

    def release(self, gpu: ManagedGpu, lease: Lease, now_s: float) -> list[Work]:
        state = gpu.exclusive
        if state is not None and state.lease_id == lease.lease_id:
            state.lease_id = None
        return []

    def restore(self, gpu: ManagedGpu, lease: Lease) -> str:
        state = gpu.exclusive
        if state is None or lease.mode is not GpuMode.EXCLUSIVE:
            return elsewhere(gpu, lease)
        state.lease_id = lease.lease_id
        return ""

    def largest_placeable(self, gpu: ManagedGpu) -> tuple[str, int] | None:
        return None if gpu.exclusive_lease else ("whole-gpu", gpu.memory_total_mib)

    def placeable_mib(self, gpu: ManagedGpu) -> int:
        return 0 if gpu.exclusive_lease else gpu.memory_total_mib

    def allocated_mib(self, gpu: ManagedGpu) -> int:
        return gpu.memory_total_mib if gpu.exclusive_lease else 0

    def holding(self, gpu: ManagedGpu, lease: Lease) -> Holding:
        return Holding()

    def restart_room(self, gpu: ManagedGpu, holding: Holding) -> tuple[tuple[int, ...], int]:
        return (), gpu.memory_total_mib  # it had the whole GPU


class OffOps:
    """OFF: migd does not manage the GPU; it is never a candidate, so it holds nothing."""

    mode = GpuMode.OFF

    def serves(self, gpu: ManagedGpu, request_mode: RequestMode) -> bool:
        return False

    def admits_by_uid(self, gpu: ManagedGpu) -> bool:
        return False

    def ever_fits(self, gpu: ManagedGpu, request: LeaseRequest) -> Fit:
        return Fit()

    def shape(self, gpu: ManagedGpu, request: LeaseRequest) -> tuple[Hashable, Hashable] | None:
        return None

    def clear_waiting(self, gpu: ManagedGpu) -> None:
        return

    def place(self, lease: Lease, gpus: Sequence[ManagedGpu], now_s: float) -> Work | None:
        return None

    def release(self, gpu: ManagedGpu, lease: Lease, now_s: float) -> list[Work]:
        return []

    def restore(self, gpu: ManagedGpu, lease: Lease) -> str:
        return elsewhere(gpu, lease)

    def work_done(self, gpu: ManagedGpu, work: Work, created: Created, now_s: float) -> None:
        return

    def why_not(self, gpu: ManagedGpu) -> dict[str, Any]:
        return {"gpu": gpu.index, "mode": gpu.mode.value, "why": "not managed by migd"}

    def largest_placeable(self, gpu: ManagedGpu) -> tuple[str, int] | None:
        return None

    def placeable_mib(self, gpu: ManagedGpu) -> int:
        return 0

    def allocated_mib(self, gpu: ManagedGpu) -> int:
        return 0

    def holding(self, gpu: ManagedGpu, lease: Lease) -> Holding:
        return Holding()

    def restart_room(self, gpu: ManagedGpu, holding: Holding) -> tuple[tuple[int, ...], int]:
        return (), 0

    def layout_key(self, gpu: ManagedGpu) -> Hashable | None:
        return None

    def slice_usage(self, gpu: ManagedGpu) -> tuple[int, int]:
        return 0, 0
