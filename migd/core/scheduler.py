"""The node scheduler: leases, queue and GPU bookkeeping, with no I/O.

The daemon and the simulator drive this same object; they differ only in what
happens around it. The daemon executes the returned :class:`Work` on the real
(or simulated) backend, persists leases and reports back with
:meth:`NodeScheduler.work_done` / :meth:`NodeScheduler.work_failed`; the
simulator does the same with simulated time and costs.

State is *intended* state: a plan is committed at once (destroyed instances
gone, the new instance ``CREATING`` and owned by its lease) so concurrent
requests never plan against slices that are about to change. The backend stays
the truth: when work fails the daemon re-reads the GPU and calls
:meth:`NodeScheduler.resync`.

What differs per GPU mode (MIG with MPS inside MIG, MPS, EXCLUSIVE) is asked of
that mode's driver (:mod:`migd.core.gpu_modes`, :mod:`migd.core.mig_mode`), picked
by :meth:`NodeScheduler.mode_ops`; this module keeps the queue, the lease table,
the transition table and the outcomes.

Invariants (tested with hypothesis in tests/property/test_scheduler.py):

* an instance with a lease, or with processes migd cannot explain, is never in
  a destroy operation;
* every lease that holds resources points at exactly one instance or share;
* the committed layout of every GPU is a valid state of its state machine.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from migd.core.demand import DemandModel
from migd.core.geometry import Profile
from migd.core.gpu_modes import (
    Created,
    ExclusiveOps,
    GpuModeOps,
    MpsOps,
    OffOps,
    mps_thread_percentage,
    partition_request,
)
from migd.core.gpus import (
    ExclusiveState,
    GpuMode,
    InstanceStatus,
    ManagedGpu,
    ManagedInstance,
    MigState,
    MpsState,
    OffState,
    Origin,
    RequestMode,
    Work,
    mode_state,
)
from migd.core.lease_end import LeaseEndReason
from migd.core.leases import Lease, LeaseEvent, LeaseRequest, LeaseState
from migd.core.mig_mode import MigOps
from migd.core.mps import MpsPool, client_environment, observe_client_cap
from migd.core.planner import (
    CreateOp,
    DestroyOp,
    Op,
    Sizing,
    never_fits_error,
)
from migd.core.policy import SchedulerPolicy
from migd.core.queueing import Miss, QueuedRequest, QueuePolicy, RequestQueue
from migd.core.states import StateSpace
from migd.errors import InvalidRequest, NoCapacity

# The lease (migd.core.leases), GPU and work (migd.core.gpus) and policy (migd.core.policy)
# types live beside the scheduler; callers keep importing them here.
__all__ = [
    "ExclusiveState",
    "GpuMode",
    "InstanceStatus",
    "Lease",
    "LeaseRequest",
    "ManagedGpu",
    "ManagedInstance",
    "MigState",
    "MpsState",
    "NodeScheduler",
    "OffState",
    "Origin",
    "Outcome",
    "RequestMode",
    "SchedulerPolicy",
    "Transition",
    "Work",
    "default_mps_env",
    "mode_state",
]


@dataclass(frozen=True)
class Transition:
    """A lease's state change within one scheduler mutation (first state to last)."""

    lease: Lease
    old: LeaseState | None  # None: the lease is new to the scheduler
    new: LeaseState


@dataclass
class Outcome:
    """Everything one scheduler mutation did, for the caller to act on in one way.

    The caller (daemon or simulator) executes ``work`` in order per GPU and reports
    each item back (:meth:`NodeScheduler.work_done` / :meth:`NodeScheduler.work_failed`),
    and hands ``transitions`` to whatever observes leases (store, log, metrics). Work
    includes the follow-on scheduling pass a mutation makes possible (a release frees
    slices, so queued requests are placed in the same outcome): callers never run
    :meth:`NodeScheduler.schedule` after one, only when the world changed outside the
    scheduler's books (a GPU re-read, its health, the policy).
    """

    work: list[Work] = field(default_factory=list)
    transitions: list[Transition] = field(default_factory=list)
    #: ``submit``: the submitted lease, and its queue position when it waits.
    lease: Lease | None = None
    queued_position: int | None = None
    #: ``submit``: why the lease was refused (it is not kept); raise it after acting on
    #: the rest, which the same pass may have started for leases queued before it.
    refusal: NoCapacity | None = None
    #: ``resync``: what changed, in words.
    notes: list[str] = field(default_factory=list)
    #: ``resync``: the read was older than the books (nothing changed): read again.
    stale: bool = False
    #: Every lease the mutation changed, a net transition or not (a placement that fell
    #: through and was placed again is PREPARING before and after, on another slice):
    #: what the caller persists, so it never scans every lease.
    touched: list[Lease] = field(default_factory=list)

    @property
    def grants(self) -> list[Lease]:
        """Leases that became active."""
        return [t.lease for t in self.transitions if t.new is LeaseState.ACTIVE]

    @property
    def ended(self) -> list[Lease]:
        """Leases that reached a terminal state."""
        return [t.lease for t in self.transitions if t.new.terminal]


class NodeScheduler:
    """All placement decisions of one node; see the module docstring."""

    def __init__(
        self,
        gpus: Sequence[ManagedGpu],
        policy: SchedulerPolicy | None = None,
        *,
        mps_env: Callable[[ManagedGpu, Lease], dict[str, str]] | None = None,
    ) -> None:
        self.gpus: dict[int, ManagedGpu] = {g.index: g for g in gpus}
        self.policy = policy or SchedulerPolicy()
        self.leases: dict[str, Lease] = {}
        self.queue: RequestQueue[str] = self._new_queue()
        self.demand = DemandModel(
            prior=dict(self.policy.demand_prior), half_life_s=self.policy.demand_half_life_s
        )
        self._work_ids = itertools.count(1)
        self._pending_work: dict[int, Work] = {}
        self._stale_work: set[int] = set()
        # The queue entry of each placed lease, to put it back with its arrival time if
        # its work fails (a retry must not lose its place).
        self._placed_items: dict[str, QueuedRequest[str]] = {}
        self._mps_env = mps_env or default_mps_env
        # What depends on a GPU's mode is asked of its driver, in this order (placement).
        self._mps = MpsOps(self)
        self._drivers: dict[GpuMode, GpuModeOps] = {
            GpuMode.MIG: MigOps(self),
            GpuMode.MPS: self._mps,
            GpuMode.EXCLUSIVE: ExclusiveOps(self),
            GpuMode.OFF: OffOps(),
        }
        # The request that ended the last scheduling pass, if one did (see release).
        self._blocked_by: str | None = None
        # Leases changed by the mutation in progress, with their state before it.
        self._changed: dict[str, tuple[Lease, LeaseState | None]] = {}
        # Per GPU, a number every change of its books bumps (see books_version).
        self._books_version: dict[int, int] = dict.fromkeys(self.gpus, 0)
        # Each request's placement shape, kept across passes while no GPU's mode, state
        # space or MPS-in-MIG setting changes (what a shape depends on besides the
        # request): see _placement_shape.
        self._shape_modes: tuple[Hashable, ...] = ()
        self._shapes: dict[Hashable, Hashable | None] = {}

    def _new_queue(self) -> RequestQueue[str]:
        return RequestQueue(
            policy=self.policy.queue,
            aging_s=self.policy.aging_s,
            starvation_s=self.policy.starvation_s,
            backfill=self.policy.backfill,
        )

    def transition(
        self,
        lease: Lease,
        event: LeaseEvent,
        now_s: float,
        reason: str = "",
        *,
        end: LeaseEndReason | None = None,
    ) -> None:
        """Every state change goes through here (and the transition table), the mode
        drivers' too, so the mutation's outcome lists it. ``end``: why the lease ends,
        when the event ends it (default: what the event means, ``DEFAULT_END``)."""
        self._changed.setdefault(lease.lease_id, (lease, lease.state))
        lease.event(event, now_s, reason, end=end)

    def _outcome(self, work: list[Work] | None = None, **fields: Any) -> Outcome:
        """The mutation's outcome: its work and the leases' net state changes."""
        transitions = [
            Transition(lease, old, lease.state)
            for lease, old in self._changed.values()
            if lease.state is not old
        ]
        touched = [lease for lease, _ in self._changed.values()]
        self._changed.clear()
        # Besides the bumps where the books change, every GPU an outcome names (its work,
        # its leases') counts as changed: a missed bump would let a stale read through.
        for item in work or ():
            self._touch(item.gpu)
        for t in transitions:
            self._touch(t.lease.gpu)
        return Outcome(work=work or [], transitions=transitions, touched=touched, **fields)

    # -- the books' versions ----------------------------------------------------------------

    def books_version(self, gpu_index: int) -> int:
        """A number that changes whenever the books of GPU ``gpu_index`` change (its
        instances, their status, origin and leases; work planned, done or failed there).

        Whoever reads a GPU (NVML) to correct its books takes this before the read and
        hands it to :meth:`resync`, which refuses a read older than the books: what the
        read missed (a create that finished and was granted meanwhile) would otherwise be
        undone, its lease reclaimed as "disappeared" and the instance handed out twice.
        """
        return self._books_version.get(gpu_index, 0)

    def _touch(self, gpu_index: int | None) -> None:
        if gpu_index is not None:
            self._books_version[gpu_index] = self._books_version.get(gpu_index, 0) + 1

    def set_policy(self, policy: SchedulerPolicy) -> None:
        """Swap the policy (config reload); queued requests keep their arrival times."""
        old = list(self.queue)
        self.policy = policy
        self.queue = self._new_queue()
        for item in old:
            self.queue.restore(item)
        self.demand.prior = dict(policy.demand_prior)
        self.demand.half_life_s = policy.demand_half_life_s

    # -- submission -------------------------------------------------------------------------

    def submit(self, lease: Lease, now_s: float, mono_s: float) -> Outcome:
        """Place ``lease`` now, queue it, or refuse it.

        A refusal (it does not fit now and ``wait_s`` is 0, or requests queued ahead of
        it must go first) is the outcome's ``refusal``; the lease is not kept, and the
        outcome's work is what the same pass started for leases queued before it.

        Raises:
            RequestTooLarge: it can never fit on this node (nothing changed).
            InvalidRequest: the request names GPUs this node does not have.
        """
        if lease.lease_id in self.leases:
            raise InvalidRequest(f"lease {lease.lease_id} exists already")
        candidates = self._candidate_gpus(lease.request)
        sizes = self._check_ever_fits(lease, candidates)
        # Demand counts what is asked for, granted or not, as the profile it right-sizes
        # to on each model (not what a grant creates: an upsized 4g.20gb was a 3g.20gb
        # request).
        for model, profile in sizes.items():
            self.demand.observe(model, profile.profile_id, now_s)
        lease.updated_s = now_s
        self.leases[lease.lease_id] = lease
        self._changed[lease.lease_id] = (lease, None)
        wait_s = lease.request.wait_s
        self.queue.push(
            lease.lease_id,
            lease.lease_id,
            now_s=mono_s,
            memory_mib=lease.request.memory_mib,
            wait_s=wait_s if wait_s is None or wait_s > 0 else 0.0,
            klass=placement_class(lease),
        )
        if wait_s is not None:
            lease.deadline_s = now_s + wait_s
        work = self._schedule(now_s, mono_s)
        if lease.state is LeaseState.QUEUED:
            if wait_s is not None and wait_s <= 0:
                self.queue.remove(lease.lease_id)
                del self.leases[lease.lease_id]
                self._changed.pop(lease.lease_id, None)
                refusal = NoCapacity(
                    f"no partition for {lease.request.memory_mib} MiB is free now",
                    considered=self._why_not(lease),
                )
                return self._outcome(work, lease=lease, refusal=refusal)
            position = self.queue.position(lease.lease_id, mono_s)
            return self._outcome(work, lease=lease, queued_position=position)
        return self._outcome(work, lease=lease)

    def _candidate_gpus(self, request: LeaseRequest) -> list[ManagedGpu]:
        gpus = [g for g in self.gpus.values() if g.mode is not GpuMode.OFF]
        if request.gpu_uuids:
            wanted = [u.strip() for u in request.gpu_uuids if u.strip()]
            chosen = [
                g for g in gpus if any(g.uuid.startswith(w) or str(g.index) == w for w in wanted)
            ]
            if not chosen:
                raise InvalidRequest(
                    f"no managed GPU matches {', '.join(wanted)}",
                    hint="use GPU UUIDs (or short UUIDs) as AssignedGPUs shows, or indices",
                )
            gpus = chosen
        gpus = [g for g in gpus if self.mode_ops(g).serves(g, request.mode)]
        if not gpus:
            raise InvalidRequest(
                f"no GPU on this node serves mode={request.mode}",
                hint="use mode=auto, or configure a GPU for that mode in migd.toml",
            )
        return gpus

    def check_ever_fits(self, lease: Lease) -> None:
        """What :meth:`submit` checks first, without submitting (for matchers).

        Raises:
            RequestTooLarge: no partition on this node can ever hold the request.
            InvalidRequest: the request names GPUs or a mode this node does not have.
            UnknownProfile: it names a profile no GPU here has.
        """
        self._check_ever_fits(lease, self._candidate_gpus(lease.request))

    def _check_ever_fits(self, lease: Lease, gpus: Sequence[ManagedGpu]) -> dict[str, Profile]:
        """The profile the request right-sizes to on each MIG model here.

        Raises:
            RequestTooLarge: nothing here could ever hold it; the message says why for
                each model (too much memory, more compute slices than any profile, a
                named profile too small).
            UnknownProfile: it names a profile no GPU here has.
        """
        sizes: dict[str, Profile] = {}
        sizings: list[tuple[StateSpace, Sizing]] = []
        others: list[str] = []
        largest = 0
        fits = False
        for g in gpus:
            fit = self.mode_ops(g).ever_fits(g, lease.request)
            fits = fits or fit.fits
            largest = max(largest, fit.largest_mib)
            if fit.demand is not None:
                sizes.setdefault(*fit.demand)
            if fit.sizing is not None:
                sizings.append(fit.sizing)
            if fit.why:
                others.append(fit.why)
        if not fits:
            raise never_fits_error(partition_request(lease.request), sizings, others, largest)
        return sizes

    # -- the scheduling pass ----------------------------------------------------------------

    def schedule(self, now_s: float, mono_s: float) -> Outcome:
        """Try queued requests in policy order (after a change outside the books: a GPU
        re-read, its health, the policy); the outcome has the work for those placed."""
        return self._outcome(self._schedule(now_s, mono_s))

    def _schedule(self, now_s: float, mono_s: float) -> list[Work]:
        work: list[Work] = []
        # Per-user MPS drain marks say who is waiting *now*: this pass sets them again for
        # the requests still queued, so a request that left (refused, expired, placed
        # elsewhere) cannot reserve a device for a user who no longer waits.
        for gpu in self.gpus.values():
            self.mode_ops(gpu).clear_waiting(gpu)
        # Within one pass nothing is released, so a request that sizes like one that did
        # not fit will not fit either: a long size-ordered queue costs one plan per
        # distinct partition size, not one per queued job or per distinct MiB figure.
        failed: set[Hashable] = set()
        # Hybrid: MPS admission depends on the user and on MiB, monotonically: a user's
        # request of this shape that needs at least as much as one refused in this pass
        # is refused too (least refused MiB per (uid, shape)).
        refused_mib: dict[Hashable, int] = {}
        # Within one pass the GPUs' modes do not change: a request's shape and whether
        # MPS may take it follow from its size and placement class alone, so each is
        # worked out once per queue bucket, not once per queued request.
        shapes = self._shape_memo()
        mps_capable: dict[str, bool] = {}

        def try_place(item: QueuedRequest[str]) -> bool | Miss:
            lease = self.leases.get(item.payload)
            if lease is None or lease.state is not LeaseState.QUEUED:
                return True  # stale entry: drop it
            request = lease.request
            by_uid = mps_capable.get(request.mode)
            if by_uid is None:
                by_uid = mps_capable[request.mode] = self._mps_capable(lease)
            asked = (
                request.memory_mib,
                request.min_compute,
                request.profile,
                request.mode,
                request.gpu_uuids,
            )
            if asked in shapes:
                placement = shapes[asked]
            else:
                if len(shapes) >= 1024:  # free-form sizes: bounded, not a leak
                    shapes.clear()
                placement = shapes[asked] = self._placement_shape(request)
            shape = None if by_uid else placement
            # A miss the memo explains holds for every request of this bucket (same size
            # and class, so same shape, uid and need): the queue skips the rest of it.
            if shape is not None and shape in failed:
                return Miss.CLASS
            share_key: Hashable = None
            need = request.memory_mib * request.mps_clients
            if shape is None and self.policy.hybrid is not None:
                share_key = (lease.owner_uid, placement)
                if need >= refused_mib.get(share_key, math.inf):
                    return Miss.CLASS
            placed = self._place(lease, now_s)
            if placed is None:
                if shape is not None:
                    failed.add(shape)
                if share_key is not None:
                    refused_mib[share_key] = min(need, refused_mib.get(share_key, need))
                return Miss.CLASS if shape is not None or share_key is not None else False
            if placed.ops:
                # kept until its work is done or fails (a failure puts it back in place)
                self._placed_items[lease.lease_id] = item
                work.append(placed)
            return True

        self._blocked_by = self.queue.schedule(mono_s, try_place).blocked_by
        return work

    def _shape_memo(self) -> dict[Hashable, Hashable | None]:
        """The placement shapes worked out so far, by request; emptied when a GPU's mode,
        state space or MPS-in-MIG setting changed since (a pass asked every GPU's mode
        driver for each bucket's shape before, issue 26 §4)."""
        # (a mode's state object stands for its mode: the same object, the same mode)
        modes = tuple(
            (st, st.space, st.mps_in_mig) if type(st) is MigState else st
            for st in [g.state for g in self.gpus.values()]
        )
        if modes != self._shape_modes:
            self._shape_modes, self._shapes = modes, {}
        return self._shapes

    def _placement_shape(self, request: LeaseRequest) -> Hashable | None:
        """What decides whether ``request`` can be placed now, apart from MPS.

        The profile it right-sizes to on each MIG model (memory and ``min_compute`` only
        matter through it), the GPUs it may use and its mode; its MiB only where a GPU in
        exclusive mode could take it. ``None`` when it cannot be placed at all.
        """
        try:
            gpus = self._candidate_gpus(request)
        except InvalidRequest:
            return None
        # Per model, the first GPU's size decides (as for demand); a GPU in exclusive mode
        # adds the MiB.
        parts: dict[Hashable, Hashable] = {}
        for g in gpus:
            part = self.mode_ops(g).shape(g, request)
            if part is not None:
                parts.setdefault(*part)
        return (request.mode, request.gpu_uuids, tuple(sorted(parts.items(), key=repr)))

    def _mps_capable(self, lease: Lease) -> bool:
        """MPS admission depends on the requester's uid, not only on the request's shape."""
        return lease.request.mode != "mig" and any(
            self.mode_ops(g).admits_by_uid(g) for g in self.gpus.values()
        )

    def _place(self, lease: Lease, now_s: float) -> Work | None:
        """Place one lease now, or return None. Commits the decision on success.

        Each mode's driver tries its candidate GPUs, in the drivers' order (MIG, with
        MPS inside MIG first, then MPS GPUs, then whole GPUs)."""
        try:
            gpus = self._candidate_gpus(lease.request)
        except InvalidRequest:
            return None
        for mode, driver in self._drivers.items():
            mine = [g for g in gpus if g.mode is mode]
            if mine and (work := driver.place(lease, mine, now_s)) is not None:
                return work
        return None

    def mode_ops(self, gpu: ManagedGpu) -> GpuModeOps:
        """The driver of ``gpu``'s mode: what the scheduler, status and metrics ask about
        anything that differs per mode."""
        return self._drivers[gpu.mode]

    # -- what the mode drivers use (gpu_modes.ModeBooks) --------------------------------

    def queued(self) -> Iterable[QueuedRequest[str]]:
        return iter(self.queue)

    def new_work(self, gpu: int, lease_id: str | None, ops: tuple[Op, ...] = ()) -> Work:
        work = Work(gpu, ops, lease_id, "grant", next(self._work_ids))
        self._touch(gpu)
        if ops:
            self._pending_work[work.work_id] = work
        return work

    def mps_env(self, gpu: ManagedGpu, lease: Lease) -> dict[str, str]:
        return self._mps_env(gpu, lease)

    def mps_pool(self, gpu: ManagedGpu) -> MpsPool:
        """An MPS-mode GPU's accounting, created on first use from the policy."""
        return self._mps.pool(gpu)

    mps_thread_percentage = staticmethod(mps_thread_percentage)

    def observe_mps_client_cap(self, device_uuid: str, clients_at_refusal: int) -> bool:
        """Lower an MPS device's client capacity to the cap it showed at a refusal
        (:func:`migd.core.mps.observe_client_cap`); whether the books changed. The caller
        schedules afterwards (nothing new fits, but queued requests may go elsewhere)."""
        for gpu in self.gpus.values():
            state = gpu.state
            pool = state.pool if isinstance(state, MpsState) else None
            if pool is not None and pool.device_uuid == device_uuid:
                assert isinstance(state, MpsState)
                state.pool = observe_client_cap(pool, clients_at_refusal)
                return state.pool is not pool
            for inst in gpu.instances:
                if inst.mps_pool is not None and inst.mps_pool.device_uuid == device_uuid:
                    new = observe_client_cap(inst.mps_pool, clients_at_refusal)
                    changed, inst.mps_pool = new is not inst.mps_pool, new
                    return changed
        return False

    # -- work results -----------------------------------------------------------------------

    def work_is_current(self, work: Work) -> bool:
        """False for work a failure made obsolete; the caller must not execute it."""
        return work.work_id not in self._stale_work

    def work_done(
        self,
        work: Work,
        created: Created,
        now_s: float,
        mono_s: float,
    ) -> Outcome:
        """Record finished work. ``created`` maps start -> (gi_id, mig_uuid, memory_mib).

        The outcome has the grants it completes and the queued requests that now fit.
        """
        self._work_done(work, created, now_s)
        self._stamp_idle(self.gpus[work.gpu], now_s, mono_s)
        return self._outcome(self._schedule(now_s, mono_s))

    def _work_done(self, work: Work, created: Created, now_s: float) -> None:
        if work.work_id in self._stale_work:
            self._stale_work.discard(work.work_id)
            return
        self._pending_work.pop(work.work_id, None)
        if work.lease_id:
            self._placed_items.pop(work.lease_id, None)
        self._touch(work.gpu)
        gpu = self.gpus[work.gpu]
        self.mode_ops(gpu).work_done(gpu, work, created, now_s)

    def work_failed(self, work: Work, error: Exception, now_s: float) -> Outcome:
        """Undo the intended state of failed work; the caller then re-reads the GPU
        (:meth:`resync`) and runs :meth:`schedule` (no pass runs here: the books of
        the GPU are not trusted until it is re-read).

        Instances it was destroying come back; later work that planned on their slices
        is made stale (:meth:`work_is_current`) and its leases go back to the queue.
        """
        self._work_failed(work, error, now_s)
        return self._outcome()

    def _work_failed(self, work: Work, error: Exception, now_s: float) -> None:
        if work.work_id in self._stale_work:
            self._stale_work.discard(work.work_id)
            return
        self._pending_work.pop(work.work_id, None)
        self._touch(work.gpu)
        gpu = self.gpus[work.gpu]
        # Only MIG GPUs get work with NVML operations; other grants have none to undo.
        instances = gpu.mig.instances if gpu.mig is not None else []
        restored: list[ManagedInstance] = []
        # Undo only this work's intentions: other work on the GPU may be in flight.
        for op in work.ops:
            if isinstance(op, DestroyOp):
                inst = gpu.instance_at(op.start, InstanceStatus.DESTROYING)
                if inst is not None and inst.profile == op.profile:
                    inst.status = InstanceStatus.READY
                    restored.append(inst)
            else:
                inst = gpu.instance_at(op.start, InstanceStatus.CREATING)
                if inst is not None and inst.profile == op.profile:
                    instances.remove(inst)
                    for waiting in self._leases_on(inst):  # an MPS host's other shares
                        self._retry(waiting, f"placement failed: {error}", now_s)
        self._retry(self.leases.get(work.lease_id or ""), f"placement failed: {error}", now_s)
        for inst in restored:
            units = inst.profile.units_mask(inst.start)
            for other in [
                o
                for o in instances
                if o.status is InstanceStatus.CREATING and o.profile.units_mask(o.start) & units
            ]:
                instances.remove(other)
                for pending in list(self._pending_work.values()):
                    if pending.gpu == gpu.index and any(
                        isinstance(op, CreateOp) and op.start == other.start for op in pending.ops
                    ):
                        del self._pending_work[pending.work_id]
                        self._stale_work.add(pending.work_id)
                        ended = self.leases.get(pending.lease_id or "")
                        if ended is None or ended.state.terminal:
                            # Stale work's completion is ignored, and no retry runs for
                            # a lease that ended: its queue entry goes now.
                            self._placed_items.pop(pending.lease_id or "", None)
                        for op in pending.ops:  # its own destroys did not happen either
                            victim = gpu.instance_at(op.start, InstanceStatus.DESTROYING)
                            if isinstance(op, DestroyOp) and victim is not None:
                                victim.status = InstanceStatus.READY
                for waiting in self._leases_on(other):
                    self._retry(waiting, f"{inst} could not be destroyed ({error})", now_s)

    def _leases_on(self, inst: ManagedInstance) -> list[Lease]:
        """The leases an instance serves: its own, or the shares of an MPS host."""
        return [self.leases[i] for i in inst.lease_ids if i in self.leases]

    def _retry(self, lease: Lease | None, reason: str, now_s: float) -> None:
        """Send a lease whose placement fell through back to the queue, keeping its place."""
        if lease is None:
            return
        item = self._placed_items.pop(lease.lease_id, None)
        if lease.state is not LeaseState.PREPARING:  # released meanwhile: nothing to retry
            return
        lease.gpu = lease.gpu_uuid = lease.profile = lease.start = None
        lease.memory_limit_mib = None
        self.transition(lease, LeaseEvent.RETRY, now_s, reason=reason)
        if item is not None:
            self.queue.restore(item)

    def resync(
        self,
        gpu_index: int,
        observed: Iterable[tuple[Profile, int, int | None, str | None, int]],
        busy_uuids: set[str],
        now_s: float,
        *,
        read_at: int,
    ) -> Outcome:
        """Make a GPU's bookkeeping match what the backend reports.

        ``observed`` holds ``(profile, start, gi_id, mig_uuid, memory_mib)`` per instance,
        read when the GPU's :meth:`books_version` was ``read_at``. A read older than the
        books changes nothing: the outcome is ``stale`` and the caller reads again (what
        changed since, a create granted or a destroy planned, is not in the read, and
        judging it from there would reclaim a live lease or hand an instance out twice).

        Instances we know keep their lease; new ones are adopted (idle) unless processes
        run on them without a lease, which makes them UNEXPLAINED: reported, never
        destroyed. Work still pending keeps its instances as they are (CREATING,
        DESTROYING). The outcome's notes say what changed, in words; leases of instances
        that disappeared are reclaimed. No scheduling pass: the caller runs
        :meth:`schedule` once it has judged the GPU (see the daemon's reconciler).
        """
        gpu = self.gpus[gpu_index]
        mig = gpu.mig
        assert mig is not None and mig.space is not None, "only MIG GPUs have instances"
        if read_at != self.books_version(gpu_index):
            return self._outcome(stale=True, notes=["the GPU changed while it was read"])
        self._touch(gpu_index)
        notes: list[str] = []
        # A start can be in the books twice while work is pending (an instance being
        # destroyed and the one planned in its place): each is matched by its profile.
        known: dict[tuple[int, int], ManagedInstance] = {
            (i.start, i.profile.profile_id): i for i in mig.instances
        }
        fresh: list[ManagedInstance] = []
        for profile, start, gi_id, uuid, memory in observed:
            inst = known.pop((start, profile.profile_id), None)
            if inst is not None:
                inst.gi_id, inst.uuid, inst.memory_mib = gi_id, uuid, memory
                if inst.status is InstanceStatus.DESTROYING and self._pending_destroy(
                    gpu_index, start
                ):
                    pass  # its destroy is queued: it stays out of reach until then
                elif inst.status is not InstanceStatus.CREATING:
                    inst.status = InstanceStatus.READY
                if (
                    inst.origin is Origin.UNEXPLAINED
                    and uuid is not None
                    and uuid not in busy_uuids
                ):
                    inst.origin, inst.note = Origin.ADOPTED, ""
                    inst.idle_since_s = now_s
                    notes.append(f"{inst} is idle now; adopted")
                elif (
                    uuid in busy_uuids
                    and inst.lease_id is None
                    and inst.mps_pool is None  # an MPS host's server is a process of its own
                    and inst.status is InstanceStatus.READY
                    and inst.origin is not Origin.UNEXPLAINED
                ):
                    # An idle instance with processes (a job's child that outlived its
                    # lease): never handed out or destroyed until they exit.
                    inst.origin = Origin.UNEXPLAINED
                    inst.note = "processes run on it without a migd lease"
                    notes.append(f"{inst}: unexplained ({inst.note})")
                fresh.append(inst)
                continue
            origin, note = Origin.ADOPTED, ""
            if uuid is None:
                origin, note = Origin.UNEXPLAINED, "GPU instance without a compute instance"
            elif uuid in busy_uuids:
                origin, note = Origin.UNEXPLAINED, "processes run on it without a migd lease"
            new = ManagedInstance(
                profile=profile,
                start=start,
                memory_mib=memory,
                gi_id=gi_id,
                uuid=uuid,
                origin=origin,
                idle_since_s=now_s,
                note=note,
            )
            fresh.append(new)
            notes.append(f"{new}: {origin.value}" + (f" ({note})" if note else ""))
        for gone in known.values():
            if gone.status is InstanceStatus.CREATING:
                fresh.append(gone)  # creation still in flight
                continue
            if gone.status is InstanceStatus.DESTROYING and self._pending_destroy(
                gpu_index, gone.start
            ):
                continue  # destroyed on the GPU; its work's result is on its way
            notes.append(f"{gone} disappeared")
            for lease in self._leases_on(gone):
                if lease.state.holds_resources:
                    self.transition(
                        lease,
                        LeaseEvent.RECLAIM,
                        now_s,
                        reason=f"instance {gone} disappeared",
                        end=LeaseEndReason.INSTANCE_GONE,
                    )
        mig.instances = sorted(fresh, key=lambda i: i.start)
        # The committed layout must stay a valid state; a layout that is not is reported.
        try:
            mig.space.key_of((i.profile, i.start) for i in mig.instances)
        except Exception as exc:
            reason = f"layout not understood: {exc}"
            gpu.health.raise_("resync", reason, now_s)  # cleared by the next resync
            notes.append(reason)
        return self._outcome(notes=notes)

    def _pending_destroy(self, gpu_index: int, start: int) -> bool:
        """Whether pending work destroys the instance at ``start`` of a GPU."""
        return any(
            work.gpu == gpu_index
            and any(isinstance(op, DestroyOp) and op.start == start for op in work.ops)
            for work in self._pending_work.values()
        )

    # -- release, reclaim, expiry, idle teardown --------------------------------------------

    def release(
        self,
        lease_id: str,
        now_s: float,
        mono_s: float,
        *,
        reclaim: bool = False,
        reason: str = "",
        end: LeaseEndReason | None = None,
    ) -> Outcome:
        """End a lease (released by its owner, or reclaimed because the holder died);
        ``end`` says why (default: what the event means).

        The outcome's work: teardown of the freed instance when the idle policy says so,
        and grants for queued requests that now fit.
        """
        lease = self.leases[lease_id]
        if lease.state.terminal:
            return self._outcome()
        event = LeaseEvent.RECLAIM if reclaim else LeaseEvent.RELEASE
        was = lease.state
        self.transition(
            lease, event, now_s, reason=reason or ("reclaimed" if reclaim else "released"), end=end
        )
        self.queue.remove(lease_id)
        work: list[Work] = []
        if was.holds_resources and lease.gpu is not None:
            self._touch(lease.gpu)
            gpu = self.gpus[lease.gpu]
            work.extend(self.mode_ops(gpu).release(gpu, lease, now_s))
            self._stamp_idle(gpu, now_s, mono_s)
        if was.holds_resources or self._pass_after_leaving(lease_id):
            work.extend(self._schedule(now_s, mono_s))
        return self._outcome(work)

    def withdraw(self, lease_id: str) -> None:
        """Stop placing a queued lease whose client is gone; :meth:`release` ends it
        later (the daemon releases hung-up requests in batches, off the hot path)."""
        lease = self.leases.get(lease_id)
        if lease is not None and lease.state is LeaseState.QUEUED:
            self.queue.remove(lease_id)

    def _pass_after_leaving(self, lease_id: str) -> bool:
        """Whether a queued request that leaves (cancelled, its client gone) can let
        another be placed: only if it ended the last pass, or an MPS device is held for
        a waiting user (the pass sets those marks again for who still waits), or the
        order changes with time without backfill (``size`` without backfill: a request
        aged to the front may fit). Otherwise the last pass tried every request that
        could be placed and nothing was freed since: a mass hang-up of queued clients
        costs no pass each."""
        if lease_id == self._blocked_by:
            return True
        if not self.queue.backfills and self.policy.queue is not QueuePolicy.FIFO:
            return True
        for gpu in self.gpus.values():
            pools = [gpu.mps_pool, *(i.mps_pool for i in gpu.instances)]
            if any(p is not None and p.draining_for_uid is not None for p in pools):
                return True
        return False

    def restore(self, lease: Lease, now_s: float) -> Outcome:
        """Take back a lease found in the state db at start-up (after :meth:`resync`).

        Through the transition table like every other change: a lease that was waiting
        is cancelled (its client's connection died with the old daemon; the wrapper
        asks again); an active one whose GPU, MIG instance or MPS host is gone is
        reclaimed; any other is bound to its instance, share or GPU again.
        """
        self.leases[lease.lease_id] = lease
        self._touch(lease.gpu)
        if lease.state in (LeaseState.QUEUED, LeaseState.PREPARING):
            reason = "daemon restarted while waiting"
            self.transition(lease, LeaseEvent.RELEASE, now_s, reason=reason)
            return self._outcome()
        gpu = self.gpus.get(lease.gpu if lease.gpu is not None else -1)
        if gpu is None or gpu.uuid != lease.gpu_uuid:
            gone = "its GPU is gone"
        else:
            gone = self.mode_ops(gpu).restore(gpu, lease)
        if gone:
            self.transition(
                lease, LeaseEvent.RECLAIM, now_s, reason=gone, end=LeaseEndReason.INSTANCE_GONE
            )
        return self._outcome()

    def quarantine(self, lease_id: str, why: str) -> str | None:
        """Keep the MIG instance of ``lease_id`` from being reused or destroyed: processes
        still run on it (call before :meth:`release`, which schedules queued requests).

        The instance is UNEXPLAINED (``migctl status`` shows ``why``) until a resync finds
        it without processes. Returns the instance's name, ``None`` if the lease has none.
        """
        lease = self.leases.get(lease_id)
        if lease is None or lease.gpu is None or lease.mode is not GpuMode.MIG:
            return None
        inst = self.gpus[lease.gpu].instance_of(lease_id)
        if inst is None:
            return None
        self._touch(lease.gpu)
        inst.origin, inst.note = Origin.UNEXPLAINED, why
        return str(inst)

    def restore_mps_share(self, gpu: ManagedGpu, lease: Lease) -> bool:
        """Re-account an MPS lease found in the state db at start-up (it may overcommit),
        as :meth:`restore` does with no transition.

        A share inside a MIG instance goes back to its host instance (which becomes an
        MPS host again, explained by the lease). False: that instance is gone.
        """
        self._touch(gpu.index)
        return not self.mode_ops(gpu).restore(gpu, lease)

    def heartbeat(self, lease_id: str, now_s: float, mono_s: float) -> Lease:
        lease = self.leases[lease_id]
        lease.event(LeaseEvent.HEARTBEAT, now_s)  # keeps it ACTIVE: not a transition
        lease.heartbeat_s = now_s  # shown and stored
        lease.alive_mono_s = mono_s  # what the reaper measures silence from
        return lease

    def expire(self, now_s: float, mono_s: float) -> Outcome:
        """Expire queued requests past their deadline (the outcome's ``ended``).

        A request that left may have blocked others (FIFO, a reservation), so when any
        expired the outcome also has the work for those placed now.
        """
        gone = False
        for item in self.queue.expired(mono_s):
            lease = self.leases.get(item.payload)
            if lease is not None and lease.state is LeaseState.QUEUED:
                reason = "no partition before the deadline"
                self.transition(lease, LeaseEvent.EXPIRE, now_s, reason=reason)
                gone = True
        return self._outcome(self._schedule(now_s, mono_s) if gone else [])

    def idle_teardown(self, now_s: float, mono_s: float) -> Outcome:
        """Destroy idle instances past ``idle_timeout_s`` (policy ``timeout``).

        The torn-down slices are free in the intended layout at once (work on a GPU runs
        in order), so the outcome also places the queued requests that fit now.
        """
        if self.policy.idle_policy != "timeout":
            return self._outcome()
        work: list[Work] = []
        for gpu in self.gpus.values():  # only MIG GPUs have instances
            self._stamp_idle(gpu, now_s, mono_s)
            stale = [
                i
                for i in gpu.instances
                if not i.busy
                and i.idle_mono is not None
                # a timer set for idle_since + timeout must find it due, rounding or not
                and mono_s - i.idle_mono[1] >= self.policy.idle_timeout_s - 1e-6
            ]
            work.extend(self.teardown(gpu, stale))
        if work:
            work.extend(self._schedule(now_s, mono_s))
        return self._outcome(work)

    @staticmethod
    def _stamp_idle(gpu: ManagedGpu, now_s: float, mono_s: float) -> None:
        """Note on the monotonic clock when each instance went idle (``idle_mono``).

        The mode handlers stamp ``idle_since_s`` in wall time; a release or finished
        work is stamped here at once (exact). An instance that went idle another way
        (resync, adoption) is stamped at the next look, as ``now - idle_since_s`` ago:
        exact unless the wall clock was set in between.
        """
        for inst in gpu.instances:
            since = inst.idle_since_s
            if since is None:
                inst.idle_mono = None
            elif inst.idle_mono is None or inst.idle_mono[0] != since:
                inst.idle_mono = (since, mono_s - max(0.0, now_s - since))

    def discard_incomplete(self, gpu_index: int, own_starts: Iterable[int]) -> Outcome:
        """Destroy GPU instances without a compute instance that migd itself was making.

        A crash between creating a GPU instance and its compute instance (or during a
        destroy) leaves one behind. No process can run on it, so destroying it is always
        safe; it is only done for starts migd recorded before it began the work, so an
        admin's half-made instance is reported, not touched.
        """
        gpu = self.gpus[gpu_index]
        starts = set(own_starts)
        leftovers = [
            i
            for i in gpu.instances
            if i.uuid is None
            and i.start in starts
            and i.lease_id is None
            and i.status is InstanceStatus.READY
        ]
        for inst in leftovers:
            inst.origin, inst.note = Origin.MIGD, "incomplete: an interrupted create or destroy"
        return self._outcome(self.teardown(gpu, leftovers))

    def reset(self, gpu_index: int) -> Outcome:
        """Destroy every idle instance of a GPU (``migctl reset``); busy ones stay."""
        gpu = self.gpus[gpu_index]
        return self._outcome(self.teardown(gpu, [i for i in gpu.instances if not i.busy]))

    def teardown(self, gpu: ManagedGpu, instances: Sequence[ManagedInstance]) -> list[Work]:
        """Destroy idle instances of a MIG GPU: they are ``DESTROYING`` in the books at
        once, and the work is pending until done."""
        if not instances:
            return []
        self._touch(gpu.index)
        for inst in instances:
            assert not inst.busy
            inst.status = InstanceStatus.DESTROYING
        ops = tuple(DestroyOp(i.profile, i.start) for i in sorted(instances, key=lambda i: i.start))
        work = Work(gpu.index, ops, None, "teardown", next(self._work_ids))
        self._pending_work[work.work_id] = work
        return [work]

    def set_draining(self, gpu_index: int, draining: bool, now_s: float, mono_s: float) -> Outcome:
        """Stop (or resume) placing work on a GPU; resuming places what fits there now."""
        self.gpus[gpu_index].draining = draining
        return self._outcome([] if draining else self._schedule(now_s, mono_s))

    # -- introspection ----------------------------------------------------------------------

    def _why_not(self, lease: Lease) -> list[dict[str, Any]]:
        try:
            gpus = self._candidate_gpus(lease.request)
        except InvalidRequest as exc:
            return [{"why": exc.message}]
        out = [self.mode_ops(g).why_not(g) for g in gpus]
        if len(self.queue) > 1:
            out.append({"why": f"{len(self.queue) - 1} queued request(s) go first"})
        return out

    def active_leases(self) -> list[Lease]:
        return [lease for lease in self.leases.values() if not lease.state.terminal]

    def forget_terminal(self) -> None:
        """Drop ended leases from memory (the store keeps their history)."""
        for lease_id in [k for k, v in self.leases.items() if v.state.terminal]:
            self.forget(lease_id)

    def forget(self, lease_id: str) -> None:
        """Drop one ended lease from memory, with what the queue kept for it."""
        self.leases.pop(lease_id, None)
        self._placed_items.pop(lease_id, None)


def placement_class(lease: Lease) -> Hashable:
    """What, besides its MiB, decides whether a queued request can be placed: requests
    alike in both share a queue bucket (see :class:`migd.core.queueing.Miss`)."""
    r = lease.request
    return (r.mode, r.gpu_uuids, r.min_compute, r.profile, r.mps_clients, lease.owner_uid)


def default_mps_env(gpu: ManagedGpu, lease: Lease) -> dict[str, str]:
    """The client environment of an MPS share (the daemon adds its real pipe dir): the
    granted limit, in the one format :func:`migd.core.mps.client_environment` writes."""
    return client_environment(
        lease.mig_uuid or gpu.uuid,
        lease.memory_limit_mib or lease.request.memory_mib,
        lease.mps_thread_percentage,
    )
