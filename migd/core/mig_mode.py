"""The MIG mode driver: MIG instances of a lease's own, and MPS shares inside MIG.

A MIG GPU's instances are planned by :mod:`migd.core.planner` across every MIG GPU
at once. A GPU with ``mps_in_mig`` also hosts MPS daemons in instances migd makes
for them (:class:`MpsHosts`): small and ``mode=mps`` requests get a share of one,
and the hybrid policy (:mod:`migd.core.hybrid`), when configured, decides per
request and sizes new hosts.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import Any

from migd.core.capacity import placeable_mib
from migd.core.geometry import Profile
from migd.core.gpu_modes import (
    Created,
    Fit,
    Holding,
    ModeBooks,
    elsewhere,
    grant,
    mps_request,
    partition_request,
    restored_share,
)
from migd.core.gpus import (
    GpuMode,
    InstanceStatus,
    ManagedGpu,
    ManagedInstance,
    Origin,
    RequestMode,
    Work,
)
from migd.core.hybrid import Route
from migd.core.leases import Lease, LeaseEvent, LeaseRequest, LeaseState
from migd.core.mps import (
    DeviceKind,
    MpsPool,
    MpsRequest,
    UserPolicy,
    can_admit,
    clear_waiting,
    mark_waiting,
    max_clients_for,
)
from migd.core.mps import admit as mps_admit
from migd.core.mps import release as mps_release
from migd.core.planner import (
    CreateOp,
    Decision,
    DestroyOp,
    PartitionRequest,
    PlacementRule,
    Sizing,
    plan_on_gpu,
    plan_on_node,
    size_request,
)
from migd.core.states import StateSpace, describe
from migd.errors import MigdError, NoCapacity, RequestTooLarge, UnknownProfile


class MigOps:
    """MIG: instances of its own per lease, and MPS shares inside host instances."""

    mode = GpuMode.MIG

    def __init__(self, books: ModeBooks) -> None:
        self.books = books
        self.hosts = MpsHosts(books)
        # The profile a request right-sizes to, per state space (a GPU model's) and
        # request size: asked of every MIG GPU by each shape and ever-fits check, and it
        # never changes for a space (as the pre-split scheduler memoised it per model).
        # (Keyed by the request's fields, not a PartitionRequest: making one per GPU and
        # per check cost more than the look-up.)
        self._sizings: dict[tuple[int, int, int, str | None], tuple[StateSpace, Sizing]] = {}
        self._fits: dict[tuple[int, int], tuple[StateSpace, Fit]] = {}

    def sizing(self, space: StateSpace, request: LeaseRequest) -> Sizing:
        """:func:`size_request`, memoised per (space, request size)."""
        key = (id(space), request.memory_mib, request.min_compute, request.profile)
        hit = self._sizings.get(key)
        if hit is not None and hit[0] is space:
            return hit[1]
        if len(self._sizings) >= 4096:  # free-form sizes: bounded, not a leak
            self._sizings.clear()
        sizing = size_request(space, partition_request(request))
        self._sizings[key] = (space, sizing)
        return sizing

    def serves(self, gpu: ManagedGpu, request_mode: RequestMode) -> bool:
        return request_mode != "mps" or gpu.mps_in_mig

    def admits_by_uid(self, gpu: ManagedGpu) -> bool:
        return gpu.mps_in_mig

    def ever_fits(self, gpu: ManagedGpu, request: LeaseRequest) -> Fit:
        if gpu.space is None:
            # No state machine (no MIG geometry, profiles it lacks): say so, or a node of
            # such GPUs refused every job with an empty reason (issue 24 s4).
            why = str(gpu.health) if not gpu.health.available else "no usable MIG profiles"
            return Fit(why=f"GPU {gpu.index} ({gpu.model}) cannot hold MIG instances: {why}")
        if request.mode == "mps":  # only an MPS share inside an instance will do
            return self.hosts.ever_fits(gpu, request)
        space = gpu.space
        sizing = self.sizing(space, request)
        if sizing.profile is None:
            return Fit(sizing=(space, sizing))
        # the answer names only the model and the profile: one per profile of a space
        key = (id(space), sizing.profile.profile_id)
        fit = self._fits.get(key)
        if fit is None or fit[0] is not space:
            made = Fit(fits=True, demand=(space.geometry.model, sizing.profile))
            fit = self._fits[key] = (space, made)
        return fit[1]

    def shape(self, gpu: ManagedGpu, request: LeaseRequest) -> tuple[Hashable, Hashable] | None:
        # Memory and min_compute matter only through the profile they right-size to.
        if gpu.space is None:
            return None
        prof = self.sizing(gpu.space, request).profile
        size = prof.profile_id if prof is not None else None
        return (GpuMode.MIG, gpu.space.geometry.model), size

    def clear_waiting(self, gpu: ManagedGpu) -> None:
        for inst in gpu.instances:
            if inst.mps_pool is not None and inst.mps_pool.draining_for_uid is not None:
                inst.mps_pool = clear_waiting(inst.mps_pool)

    def place(self, lease: Lease, gpus: Sequence[ManagedGpu], now_s: float) -> Work | None:
        request = lease.request
        mig = [g for g in gpus if g.space is not None]
        hosts = [g for g in mig if self.hosts.routes_here(g, request)]
        if hosts:
            placed = self.hosts.place(lease, hosts, now_s)
            if placed is not None:
                self.hosts.explain(lease, hosts[0])
                return placed
        if request.mode == "mps" or not mig:
            return None  # an MPS request never takes a MIG instance of its own
        books = self.books
        planner = books.policy.planner
        if books.policy.demand_weighting:
            weights = books.demand.weights(now_s)
            if weights:
                planner = replace(planner, placement=PlacementRule.WEIGHTED, demand=weights)
        try:
            decision = plan_on_node([g.view() for g in mig], partition_request(request), planner)
        except (NoCapacity, RequestTooLarge, UnknownProfile):
            return None  # the MIG GPUs cannot take it: MPS or a whole GPU may
        work = self._commit(lease, decision, now_s)
        self.hosts.explain(lease, books.gpus[decision.gpu])
        return work

    def _commit(self, lease: Lease, decision: Decision, now_s: float) -> Work:
        gpu = self.books.gpus[decision.gpu]
        inst, work = take_partition(self.books, gpu, decision, lease.lease_id, lease.lease_id)
        self.books.transition(lease, LeaseEvent.PLAN, now_s)
        grant(lease, gpu, GpuMode.MIG)
        lease.profile, lease.start = decision.profile.name, decision.start
        lease.memory_limit_mib = decision.profile.memory_mib
        lease.decision = decision.to_dict()
        if decision.action == "reuse":
            inst.lease_id, inst.idle_since_s = lease.lease_id, None
            self._activate(lease, inst, now_s)
        return work

    def _activate(self, lease: Lease, inst: ManagedInstance, now_s: float) -> None:
        lease.mig_uuid = inst.uuid
        lease.memory_limit_mib = inst.memory_mib
        uuid = inst.uuid or ""
        lease.env = {"CUDA_VISIBLE_DEVICES": uuid, "NVIDIA_VISIBLE_DEVICES": uuid}
        self.books.transition(lease, LeaseEvent.READY, now_s)
        lease.heartbeat_s = now_s

    def release(self, gpu: ManagedGpu, lease: Lease, now_s: float) -> list[Work]:
        if lease.mode is GpuMode.MPS:
            return self.hosts.release(gpu, lease, now_s)
        inst = gpu.instance_of(lease.lease_id)
        if inst is None:
            return []
        # A CREATING instance stays untouchable by its status; work_done then finds no
        # owner and marks it idle.
        inst.lease_id = None
        if inst.status is not InstanceStatus.READY:
            return []
        inst.idle_since_s = now_s
        if self.books.policy.idle_policy == "destroy" and inst.origin is not Origin.UNEXPLAINED:
            return self.books.teardown(gpu, [inst])
        return []

    def restore(self, gpu: ManagedGpu, lease: Lease) -> str:
        if lease.mode is GpuMode.MPS and lease.mig_uuid is not None:
            return "" if self.hosts.restore(gpu, lease) else "its MIG instance is gone"
        if lease.mode is not GpuMode.MIG:
            return elsewhere(gpu, lease)
        inst = gpu.instance_at(lease.start) if lease.start is not None else None
        if inst is None or (lease.mig_uuid and inst.uuid != lease.mig_uuid):
            return "its MIG instance is gone"
        inst.lease_id, inst.idle_since_s = lease.lease_id, None
        if inst.origin is Origin.UNEXPLAINED:
            inst.origin, inst.note = Origin.MIGD, ""
        return ""

    def work_done(self, gpu: ManagedGpu, work: Work, created: Created, now_s: float) -> None:
        mig = gpu.mig
        assert mig is not None
        for op in work.ops:
            if isinstance(op, DestroyOp):
                mig.instances = [
                    i
                    for i in mig.instances
                    if not (i.start == op.start and i.status is InstanceStatus.DESTROYING)
                ]
        for op in work.ops:
            if not isinstance(op, CreateOp):
                continue
            inst = gpu.instance_at(op.start, InstanceStatus.CREATING)
            assert inst is not None
            gi_id, uuid, memory = created[op.start]
            inst.gi_id, inst.uuid, inst.memory_mib = gi_id, uuid, memory
            inst.status = InstanceStatus.READY
            if inst.mps_pool is not None:  # an MPS host: its shares' leases go active
                self.hosts.created(gpu, inst, now_s)
                continue
            lease = self.books.leases.get(inst.lease_id or "")
            if lease is not None and lease.state is LeaseState.PREPARING:
                self._activate(lease, inst, now_s)
            else:  # the lease was cancelled while we were creating: now idle
                inst.lease_id, inst.idle_since_s = None, now_s

    def why_not(self, gpu: ManagedGpu) -> dict[str, Any]:
        if gpu.space is None:
            return {"gpu": gpu.index, "mode": gpu.mode.value, "why": "full or in use"}
        why = (
            "draining"
            if gpu.draining
            else (str(gpu.health) if not gpu.health.available else "busy instances in the way")
        )
        try:
            state = describe(gpu.space, gpu.view().key)
        except MigdError:  # a layout the state machine cannot describe (health says)
            state = "not understood"
        return {"gpu": gpu.index, "state": state, "why": why}

    def largest_placeable(self, gpu: ManagedGpu) -> tuple[str, int] | None:
        if gpu.space is None:
            return None
        view, policy = gpu.view(), self.books.policy.planner
        for profile in sorted(gpu.space.profiles, key=lambda p: -p.memory_mib):
            if plan_on_gpu(view, profile, policy) is not None:
                return profile.name, profile.memory_mib
        return None

    def placeable_mib(self, gpu: ManagedGpu) -> int:
        if gpu.space is None:
            return 0
        busy = [
            (i.profile, i.start)
            for i in gpu.instances
            if i.busy and i.status is not InstanceStatus.DESTROYING
        ]
        try:
            return placeable_mib(gpu.space, busy)
        except MigdError:  # a layout the state machine does not know: promise nothing
            return 0

    def allocated_mib(self, gpu: ManagedGpu) -> int:
        # A leased instance counts whole; an MPS host counts its shares' pinned limits.
        total = 0
        for inst in gpu.instances:
            if inst.lease_id is not None:
                total += inst.memory_mib
            elif inst.mps_pool is not None:
                total += inst.mps_pool.used_mib
        return total

    def holding(self, gpu: ManagedGpu, lease: Lease) -> Holding:
        # its own instance, or a share of the MPS host instance at its start
        prof = gpu.space.member(lease.profile) if gpu.space and lease.profile else None
        return Holding(prof, lease.start or 0, shared=lease.mode is GpuMode.MPS)

    def restart_room(self, gpu: ManagedGpu, holding: Holding) -> tuple[tuple[int, ...], int]:
        if holding.shared or gpu.space is None:  # an MPS share's limit grows
            return (), gpu.memory_total_mib - self.books.policy.mps_reserve_mib
        sizes = tuple(p.memory_mib for p in gpu.space.profiles)
        return sizes, max(sizes)

    def layout_key(self, gpu: ManagedGpu) -> Hashable | None:
        if gpu.space is None:
            return None
        return gpu.available, tuple(
            (i.profile.name, i.start, i.status, i.busy or i.mps_pool is not None)
            for i in gpu.instances
        )

    def slice_usage(self, gpu: ManagedGpu) -> tuple[int, int]:
        if gpu.space is None:
            return 0, 0
        held = sum(i.profile.compute_slices for i in gpu.instances)
        # the planner's layout: instances being destroyed are already gone from it
        key = gpu.space.key_of(
            (i.profile, i.start) for i in gpu.instances if i.status is not InstanceStatus.DESTROYING
        )
        compute_w, unit_w = gpu.space.wasted_slices(key)
        return held, compute_w + unit_w


def take_partition(
    books: ModeBooks, gpu: ManagedGpu, decision: Decision, lease_id: str, owner: str | None
) -> tuple[ManagedInstance, Work]:
    """Commit ``decision`` to a MIG GPU's books (:meth:`MigState.take`): the instance it
    grants, and its work (none for a reused instance, else the NVML operations, pending
    until done)."""
    mig = gpu.mig
    assert mig is not None
    inst = mig.take(decision, owner)
    ops = () if decision.action == "reuse" else decision.ops
    return inst, books.new_work(gpu.index, lease_id, ops)


class MpsHosts:
    """MPS inside MIG: shares of MPS daemons that run in MIG instances migd made for them.

    A host belongs to no lease (many share it); it is busy while it has shares, and
    plain MIG requests neither reuse nor repartition it (:meth:`ManagedGpu.view`).
    """

    def __init__(self, books: ModeBooks) -> None:
        self.books = books

    def host_profile(self, gpu: ManagedGpu) -> Profile:
        """The profile of the instances migd makes to host MPS on ``gpu``."""
        mig = gpu.mig
        assert mig is not None and mig.space is not None
        if mig.mps_profile:
            return mig.space.member(mig.mps_profile)
        return min(mig.space.profiles, key=lambda p: (p.memory_mib, p.compute_slices))

    def ever_fits(self, gpu: ManagedGpu, request: LeaseRequest) -> Fit:
        host = self.host_profile(gpu)
        capacity = max(0, host.memory_mib - self.books.policy.mps_reserve_mib)
        if request.memory_mib * request.mps_clients <= capacity:
            return Fit(fits=True, largest_mib=capacity)
        why = (
            f"{request.memory_mib} MiB x {request.mps_clients} client(s) is "
            f"more than an MPS share in GPU {gpu.index}'s {host.name} can hold "
            f"({capacity} MiB)"
        )
        return Fit(largest_mib=capacity, why=why)

    def routes_here(self, gpu: ManagedGpu, request: LeaseRequest) -> bool:
        """Whether ``request`` goes to an MPS share inside a MIG instance of ``gpu``:
        the GPU is configured for it, and the request asks for MPS or is smaller than
        the smallest instance (and names no profile)."""
        if not gpu.mps_in_mig or gpu.space is None or request.mode == "mig" or request.profile:
            return False
        if self.books.policy.hybrid is not None:
            return self.route(gpu, request).share
        if request.mode == "mps":
            return True
        smallest = min(p.memory_mib for p in gpu.space.profiles)
        return request.memory_mib < smallest

    # -- the hybrid policy's hook (migd.core.hybrid decides; this only asks and records) --

    def route(self, gpu: ManagedGpu, request: LeaseRequest) -> Route:
        hybrid = self.books.policy.hybrid
        assert hybrid is not None and gpu.space is not None
        return hybrid.route(
            gpu.space.profiles,
            request.memory_mib * request.mps_clients,
            request.min_compute,
            request.mode,
            bool(request.profile),
        )

    def _host_profiles(self, gpu: ManagedGpu, lease: Lease) -> tuple[tuple[Profile, ...], str]:
        """Profiles for a new MPS host on ``gpu``, best first, and why."""
        books = self.books
        hybrid = books.policy.hybrid
        if hybrid is None or gpu.space is None:
            return (self.host_profile(gpu),), ""
        need = lease.request.memory_mib * lease.request.mps_clients
        demand = need
        for other_gpu in books.gpus.values():  # observed demand: what this user pins in hosts
            for inst in other_gpu.instances:
                if inst.mps_pool is not None:
                    demand += sum(
                        s.memory_mib * s.clients
                        for s in inst.mps_pool.shares
                        if s.uid == lease.owner_uid
                    )
        for item in books.queued():  # and this user's share-bound backlog
            other = books.leases.get(item.payload)
            if (
                other is not None
                and other is not lease
                and other.owner_uid == lease.owner_uid
                and other.state is LeaseState.QUEUED
                and self.route(gpu, other.request).share
            ):
                demand += other.request.memory_mib * other.request.mps_clients
        return hybrid.host_profiles(gpu.space.profiles, need, demand, lease.request.min_compute)

    def explain(self, lease: Lease, gpu: ManagedGpu) -> None:
        """Put the hybrid's reason first in the lease's decision (migctl explain)."""
        if self.books.policy.hybrid is None or not gpu.mps_in_mig or lease.decision is None:
            return
        why = self.route(gpu, lease.request).reason
        host = lease.decision.pop("host_reason", "")
        lease.decision["hybrid"] = why + (f"; {host}" if host else "")
        lease.decision["reason"] = f"hybrid: {lease.decision['hybrid']}. " + str(
            lease.decision.get("reason", "")
        )

    def new_pool(
        self, gpu: ManagedGpu, profile: Profile, uuid: str | None, memory_mib: int | None = None
    ) -> MpsPool:
        """An MPS host's pool: as large as NVML says its MIG device is (``memory_mib``, an
        existing instance's), else the profile's nominal size until it exists."""
        assert gpu.space is not None
        policy = self.books.policy
        return MpsPool(
            device_uuid=uuid or f"{gpu.uuid}/{profile.name}",
            memory_total_mib=memory_mib or profile.memory_mib,
            reserve_mib=policy.mps_reserve_mib,
            max_clients=max_clients_for(
                policy.mps_max_clients,
                compute_slices=profile.compute_slices,
                total_compute_slices=gpu.space.geometry.compute_slices,
            ),
            policy=UserPolicy.MULTI_USER if policy.mps_multi_user else UserPolicy.PER_USER,
            kind=DeviceKind.MIG,
        )

    @staticmethod
    def _share(lease: Lease, profile: Profile) -> MpsRequest | None:
        """The share on a host of ``profile``; None when its compute instance is too small."""
        if lease.request.min_compute > profile.compute_slices:
            return None
        return mps_request(lease, profile.compute_slices)

    def place(self, lease: Lease, gpus: Sequence[ManagedGpu], now_s: float) -> Work | None:
        """A share on an MPS host instance: an existing one, else a new (or reused) one."""
        refused: list[tuple[ManagedGpu, ManagedInstance, int]] = []
        for gpu in gpus:
            if not gpu.available:
                continue
            for inst in gpu.instances:
                pool = inst.mps_pool
                if (
                    pool is None
                    or inst.status is InstanceStatus.DESTROYING
                    or inst.origin is Origin.UNEXPLAINED
                ):
                    continue
                share = self._share(lease, inst.profile)
                if share is None:
                    continue
                try:
                    answer = can_admit(pool, share)
                except RequestTooLarge:
                    continue
                if answer.ok:
                    return self._commit(lease, gpu, inst, share, None, now_s)
                if answer.waiting_for_uid is not None:
                    refused.append((gpu, inst, lease.owner_uid))
        work = self._new_host(lease, [g for g in gpus if g.available], now_s)
        if work is None:
            # No room for another host: the user waits for one, and drains it.
            for _gpu, inst, uid in refused[:1]:
                assert inst.mps_pool is not None
                inst.mps_pool = mark_waiting(inst.mps_pool, uid)
        return work

    def _new_host(self, lease: Lease, gpus: Sequence[ManagedGpu], now_s: float) -> Work | None:
        by_profile: dict[str, list[ManagedGpu]] = {}
        why: dict[str, str] = {}
        for gpu in gpus:
            order, reason = self._host_profiles(gpu, lease)
            for prof in order:
                by_profile.setdefault(prof.name, []).append(gpu)
                why.setdefault(prof.name, reason)
        for name, group in by_profile.items():
            assert group[0].space is not None
            profile = group[0].space.member(name)
            share = self._share(lease, profile)
            if share is None:
                continue
            try:
                can_admit(self.new_pool(group[0], profile, None), share)
            except RequestTooLarge:
                continue
            try:
                decision = plan_on_node(
                    [g.view() for g in group],
                    PartitionRequest(memory_mib=profile.memory_mib, profile=name),
                    self.books.policy.planner,
                )
            except (NoCapacity, RequestTooLarge):
                continue
            gpu = self.books.gpus[decision.gpu]
            work = self._commit(lease, gpu, None, share, decision, now_s)
            if why[name] and lease.decision is not None:
                lease.decision["host_reason"] = why[name]
            return work
        return None

    def _commit(
        self,
        lease: Lease,
        gpu: ManagedGpu,
        inst: ManagedInstance | None,
        share: MpsRequest,
        decision: Decision | None,
        now_s: float,
    ) -> Work:
        """Admit ``share`` on host ``inst``, or on the host ``decision`` makes (creating,
        reusing or repartitioning like a MIG grant). The lease is active at once on a
        ready host, else when its creation is done (:meth:`created`)."""
        books = self.books
        action = "mps-share"
        if inst is None:
            assert decision is not None and gpu.space is not None
            # A host belongs to no lease (many share it): created with no owner.
            inst, work = take_partition(books, gpu, decision, lease.lease_id, None)
            action = f"mps-host-{decision.action}"
            inst.mps_pool = self.new_pool(gpu, inst.profile, inst.uuid, inst.memory_mib)
            # A new MPS host is demand for its profile, like a request sized to it.
            books.demand.observe(gpu.space.geometry.model, decision.profile.profile_id, now_s)
        else:
            work = books.new_work(gpu.index, lease.lease_id)
        assert inst.mps_pool is not None
        pool = inst.mps_pool = mps_admit(inst.mps_pool, share)
        inst.idle_since_s = None
        books.transition(lease, LeaseEvent.PLAN, now_s)
        grant(lease, gpu, GpuMode.MPS)
        lease.profile, lease.start = inst.profile.name, inst.start
        lease.memory_limit_mib = share.memory_mib
        lease.mps_thread_percentage = share.thread_percentage
        lease.decision = {
            **(decision.to_dict() if decision is not None else {}),
            "action": action,
            "gpu": gpu.index,
            "pinned_mib": share.memory_mib,
            "mps_clients": share.clients,
            "shares_after": len(pool.shares),
            "max_clients": pool.max_clients,
            "reason": f"GPU {gpu.index}: MPS share of {share.memory_mib} MiB inside "
            f"{inst} ({pool.free_mib} MiB of {pool.capacity_mib} MiB left unpinned, "
            f"{pool.clients}/{pool.max_clients} clients)",
        }
        if inst.status is InstanceStatus.READY:
            self._activate(lease, gpu, inst, now_s)
        return work

    def _activate(self, lease: Lease, gpu: ManagedGpu, inst: ManagedInstance, now_s: float) -> None:
        lease.mig_uuid = inst.uuid
        lease.env = self.books.mps_env(gpu, lease)
        self.books.transition(lease, LeaseEvent.READY, now_s)
        lease.heartbeat_s = now_s

    def created(self, gpu: ManagedGpu, inst: ManagedInstance, now_s: float) -> None:
        """A host's creation is done: its shares' leases go active."""
        assert inst.mps_pool is not None
        # The pool holds what NVML reports for the new MIG device, not the profile's
        # nominal size (issue 13, defect 7).
        inst.mps_pool = replace(
            inst.mps_pool, device_uuid=inst.uuid or "", memory_total_mib=inst.memory_mib
        )
        for lease_id in inst.lease_ids:
            waiting = self.books.leases.get(lease_id)
            if waiting is not None and waiting.state is LeaseState.PREPARING:
                self._activate(waiting, gpu, inst, now_s)
        if not inst.mps_pool.shares:
            inst.idle_since_s = now_s

    def release(self, gpu: ManagedGpu, lease: Lease, now_s: float) -> list[Work]:
        """Drop a share from its host; an empty host may go at once (the idle policy)."""
        inst = next(
            (
                i
                for i in gpu.instances
                if i.mps_pool is not None and i.mps_pool.share(lease.lease_id) is not None
            ),
            None,
        )
        if inst is None or inst.mps_pool is None:
            return []
        inst.mps_pool = mps_release(inst.mps_pool, lease.lease_id)
        if inst.mps_pool.shares or inst.status is not InstanceStatus.READY:
            return []
        inst.idle_since_s = now_s
        policy = self.books.policy
        if (
            policy.hybrid is not None or policy.idle_policy == "destroy"
        ) and inst.origin is not Origin.UNEXPLAINED:
            # The hybrid shrinks hosts when idle: an empty host is destroyed at once (the
            # daemon stops its MPS server first), so its slices are free for any size. It
            # is never handed to a MIG lease as it is: its server may still hold the device.
            return self.books.teardown(gpu, [inst])
        return []

    def restore(self, gpu: ManagedGpu, lease: Lease) -> bool:
        """Re-account a share found in the state db at start-up (it may overcommit): its
        host instance becomes an MPS host again, explained by the lease. False: that
        instance is gone."""
        inst = gpu.instance_at(lease.start) if lease.start is not None else None
        if inst is None or inst.uuid != lease.mig_uuid or inst.lease_id is not None:
            return False
        if inst.mps_pool is None:
            inst.mps_pool = self.new_pool(gpu, inst.profile, inst.uuid, inst.memory_mib)
        inst.mps_pool = replace(
            inst.mps_pool, shares=(*inst.mps_pool.shares, restored_share(lease))
        )
        inst.idle_since_s = None
        if inst.origin is Origin.UNEXPLAINED:  # its processes are the MPS server's and jobs'
            inst.origin, inst.note = Origin.MIGD, ""
        return True
