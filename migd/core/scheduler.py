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

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from migd.core import admission
from migd.core.demand import DemandModel
from migd.core.geometry import Profile
from migd.core.gpu_modes import (
    Created,
    ExclusiveOps,
    GpuModeOps,
    MpsOps,
    OffOps,
    mps_thread_percentage,
)
from migd.core.gpus import (
    GpuMode,
    InstanceStatus,
    ManagedGpu,
    ManagedInstance,
    MigState,
    Origin,
    Work,
    observe_mps_client_cap,
)
from migd.core.groups import LeaseGroups, place_group
from migd.core.health import HealthSource
from migd.core.idle import idle_past, stamp_idle
from migd.core.lease_end import LeaseEndReason
from migd.core.leases import Lease, LeaseEvent, LeaseRequest, LeaseState
from migd.core.mig_mode import MigOps
from migd.core.mps import MpsPool, client_environment
from migd.core.planner import DestroyOp, Op
from migd.core.policy import SchedulerPolicy
from migd.core.queueing import Miss, QueuedRequest, QueuePolicy, RequestQueue
from migd.core.resync import layout_problem, match_read
from migd.core.work import WorkBook
from migd.errors import InvalidRequest, NoCapacity


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
        self._work = WorkBook()
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
        # Lease groups (migd.core.groups): who is in which, and which groups wait.
        self._groups = LeaseGroups()
        # Each request's placement shape, kept across passes while no GPU's mode, state
        # space or MPS-in-MIG setting changes (what a shape depends on besides the
        # request): see _placement_shape.
        self._shape_modes: tuple[Hashable, ...] = ()
        self._shapes: dict[Hashable, Hashable | None] = {}
        # Whether an MPS drain mark may have been set since a pass last cleared them: a
        # mark is only ever set by a placement attempt (the drivers' ``place``), so a
        # pass after none need not visit every GPU's devices to clear none (issue 26 s6:
        # most passes of a large pool find an empty queue).
        self._marks_possible = True

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
        sizes = admission.ever_fits(lease, self._candidate_gpus(lease.request), self.mode_ops)
        return self._admit([lease], sizes, placement_class(lease), now_s, mono_s)

    def submit_group(self, leases: Sequence[Lease], now_s: float, mono_s: float) -> Outcome:
        """Place a group of leases (one job on several GPUs) all at once, queue it as
        one request, or refuse it (docs/api.md, "Several GPUs per job").

        The members are placed in one step or not at all: no member holds a partition
        while the group waits for the others. Each member goes on a GPU of its own,
        except where its request pins it to a GPU another member is pinned to too
        (HTCondor assigned two shares of one GPU). The outcome's ``lease`` is the first
        member; a refusal refuses every member (none is kept).

        Raises:
            RequestTooLarge: a member can never fit here, or fewer GPUs here serve the
                request than it has members (nothing changed).
            InvalidRequest: a member names GPUs this node does not have.
        """
        if len(leases) < 2:
            raise InvalidRequest("a lease group has at least two members")
        ids = [lease.lease_id for lease in leases]
        if len(set(ids)) != len(ids) or any(i in self.leases for i in ids):
            raise InvalidRequest("the group's lease ids must be new and distinct")
        sizes = admission.group_ever_fits(leases, self.gpus.values(), self.mode_ops)
        self._groups.add(ids)
        klass = ("group", ids[0])  # a class of its own: placed as a whole
        return self._admit(leases, sizes, klass, now_s, mono_s, f" on each of {len(ids)} GPUs")

    def _admit(
        self,
        leases: Sequence[Lease],
        sizes: dict[str, Profile],
        klass: Hashable,
        now_s: float,
        mono_s: float,
        each: str = "",
    ) -> Outcome:
        """Keep admitted ``leases`` (one, or a group its first member leads) as one queue
        entry and run a pass; refuse them (keep none) if they must wait and may not."""
        # Demand counts what is asked for, granted or not, as the profile it right-sizes
        # to on each model (not what a grant creates: an upsized 4g.20gb was a 3g.20gb
        # request).
        for model, profile in sizes.items():
            self.demand.observe(model, profile.profile_id, now_s)
        leader = leases[0]
        wait_s = leader.request.wait_s
        for lease in leases:
            lease.updated_s = now_s
            if wait_s is not None:
                lease.deadline_s = now_s + wait_s
            self.leases[lease.lease_id] = lease
            self._changed[lease.lease_id] = (lease, None)
        self.queue.push(
            leader.lease_id,
            leader.lease_id,
            now_s=mono_s,
            memory_mib=leader.request.memory_mib,
            wait_s=wait_s if wait_s is None or wait_s > 0 else 0.0,
            klass=klass,
        )
        work = self._schedule(now_s, mono_s)
        if leader.state is not LeaseState.QUEUED:
            return self._outcome(work, lease=leader)
        if wait_s is None or wait_s > 0:
            position = self.queue.position(leader.lease_id, mono_s)
            return self._outcome(work, lease=leader, queued_position=position)
        self.queue.remove(leader.lease_id)
        self._groups.remove([lease.lease_id for lease in leases])
        for lease in leases:
            del self.leases[lease.lease_id]
            self._changed.pop(lease.lease_id, None)
        refusal = NoCapacity(
            f"no partition for {leader.request.memory_mib} MiB is free now{each}",
            considered=self._why_not(leader),
        )
        return self._outcome(work, lease=leader, refusal=refusal)

    def group_of(self, lease_id: str) -> tuple[str, ...]:
        """The members of ``lease_id``'s group (itself alone when it has none), while the
        scheduler keeps it."""
        return self._groups.members(lease_id)

    def _place_group(self, leader_id: str, ids: Sequence[str], now_s: float) -> list[Work] | None:
        """Place every member of a waiting group now, or none (the books are put back
        as they were: see :func:`migd.core.groups.place_group`)."""
        members = [self.leases[i] for i in ids]
        try:
            gpus = {g.index: g for lease in members for g in self._candidate_gpus(lease.request)}
        except InvalidRequest:  # a GPU it names left (a reload): it waits, as one lease would
            return None
        works = place_group(
            members,
            gpus.values(),
            self._work.pending,
            self._changed,
            lambda lease, avoid: self._place(lease, now_s, avoid=avoid),
        )
        if works is not None:
            self._groups.stop_waiting(leader_id)
        return works

    def _candidate_gpus(self, request: LeaseRequest) -> list[ManagedGpu]:
        return admission.candidate_gpus(self.gpus.values(), request, self.mode_ops)

    def check_ever_fits(self, lease: Lease) -> None:
        """What :meth:`submit` checks first, without submitting (for matchers).

        Raises:
            RequestTooLarge: no partition on this node can ever hold the request.
            InvalidRequest: the request names GPUs or a mode this node does not have.
            UnknownProfile: it names a profile no GPU here has.
        """
        admission.ever_fits(lease, self._candidate_gpus(lease.request), self.mode_ops)

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
        if self._marks_possible:
            self._marks_possible = False
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
        # (worked out at the first request tried: a pass over an empty queue needs none)
        shapes: dict[Hashable, Hashable | None] | None = None
        mps_capable: dict[str, bool] = {}

        def try_place(item: QueuedRequest[str]) -> bool | Miss:
            nonlocal shapes
            lease = self.leases.get(item.payload)
            if lease is None or lease.state is not LeaseState.QUEUED:
                return True  # stale entry: drop it
            if (ids := self._groups.waiting(lease.lease_id)) is not None:
                placed_all = self._place_group(lease.lease_id, ids, now_s)
                if placed_all is None:
                    return False
                for member_work in placed_all:
                    if member_work.ops:
                        work.append(member_work)
                return True
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
            if shapes is None:
                shapes = self._shape_memo()
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

    def _place(
        self, lease: Lease, now_s: float, *, avoid: frozenset[int] = frozenset()
    ) -> Work | None:
        """Place one lease now, or return None. Commits the decision on success.

        Each mode's driver tries its candidate GPUs (less those in ``avoid``), in the
        drivers' order (MIG, with MPS inside MIG first, then MPS GPUs, then whole GPUs)."""
        self._marks_possible = True  # a driver's place may mark an MPS device (see _schedule)
        try:
            gpus = self._candidate_gpus(lease.request)
        except InvalidRequest:
            return None
        gpus = [g for g in gpus if g.index not in avoid]
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
        self._touch(gpu)
        return self._work.new(gpu, ops, lease_id)

    def mps_env(self, gpu: ManagedGpu, lease: Lease) -> dict[str, str]:
        return self._mps_env(gpu, lease)

    def mps_pool(self, gpu: ManagedGpu) -> MpsPool:
        """An MPS-mode GPU's accounting, created on first use from the policy."""
        return self._mps.pool(gpu)

    mps_thread_percentage = staticmethod(mps_thread_percentage)

    def observe_mps_client_cap(self, device_uuid: str, clients_at_refusal: int) -> bool:
        """Lower an MPS device's client capacity to the cap it showed at a refusal
        (:func:`migd.core.gpus.observe_mps_client_cap`); whether the books changed. The
        caller schedules afterwards (nothing new fits, but queued requests may go
        elsewhere)."""
        return observe_mps_client_cap(self.gpus.values(), device_uuid, clients_at_refusal)

    # -- work results -----------------------------------------------------------------------

    def work_is_current(self, work: Work) -> bool:
        """False for work a failure made obsolete; the caller must not execute it."""
        return self._work.is_current(work)

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
        stamp_idle(self.gpus[work.gpu], now_s, mono_s)
        return self._outcome(self._schedule(now_s, mono_s))

    def _work_done(self, work: Work, created: Created, now_s: float) -> None:
        if not self._work.settle(work):
            return
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
        if not self._work.settle(work):
            return
        self._touch(work.gpu)

        def lost(inst: ManagedInstance, kept: ManagedInstance | None) -> None:
            why = f"placement failed: {error}"
            if kept is not None:
                why = f"{kept} could not be destroyed ({error})"
            for waiting in self._leases_on(inst):  # its lease, or an MPS host's shares
                self._retry(waiting, why, now_s)

        def stale(pending: Work) -> None:
            ended = self.leases.get(pending.lease_id or "")
            if ended is None or ended.state.terminal:
                # Stale work's completion is ignored, and no retry runs for a lease that
                # ended: its queue entry goes now.
                self._placed_items.pop(pending.lease_id or "", None)

        own = self.leases.get(work.lease_id or "")
        self._work.undo(
            self.gpus[work.gpu],
            work,
            lost,
            lambda: self._retry(own, f"placement failed: {error}", now_s),
            stale,
        )

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
        if self._groups.leader_of(lease.lease_id) is not None:
            # A group member alone back in the queue would leave the others holding
            # their partitions while it waits: it fails, and whoever waits for the group
            # (the daemon) releases the others and answers the job.
            self.transition(lease, LeaseEvent.FAIL, now_s, reason=reason)
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
        read = match_read(
            mig.instances,
            observed,
            busy_uuids,
            now_s,
            destroying=lambda start: self._work.destroys(gpu_index, start),
        )
        notes = read.notes
        for gone in read.gone:
            for lease in self._leases_on(gone):
                if lease.state.holds_resources:
                    self.transition(
                        lease,
                        LeaseEvent.RECLAIM,
                        now_s,
                        reason=f"instance {gone} disappeared",
                        end=LeaseEndReason.INSTANCE_GONE,
                    )
        mig.instances = read.instances
        # The committed layout must stay a valid state; a layout that is not is reported.
        if (reason := layout_problem(mig)) is not None:
            gpu.health.raise_(HealthSource.RESYNC, reason, now_s)  # cleared by the next resync
            notes.append(reason)
        return self._outcome(notes=notes)

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
        leader = self._groups.leader_of(lease_id)
        if was is LeaseState.QUEUED and leader is not None:
            # A waiting group leaves the queue as one: its other members end with it.
            self.queue.remove(leader)
            for other in self._groups.stop_waiting(leader):
                sibling = self.leases.get(other)
                if sibling is not None and sibling.state is LeaseState.QUEUED:
                    self.transition(sibling, event, now_s, reason=f"{lease_id}: {lease.reason}")
            lease_id = leader  # the queue entry that left (see _pass_after_leaving)
        work: list[Work] = []
        if was.holds_resources and lease.gpu is not None:
            self._touch(lease.gpu)
            gpu = self.gpus[lease.gpu]
            work.extend(self.mode_ops(gpu).release(gpu, lease, now_s))
            stamp_idle(gpu, now_s, mono_s)
        if was.holds_resources or self._pass_after_leaving(lease_id):
            work.extend(self._schedule(now_s, mono_s))
        return self._outcome(work)

    def withdraw(self, lease_id: str) -> None:
        """Stop placing a queued lease whose client is gone; :meth:`release` ends it
        later (the daemon releases hung-up requests in batches, off the hot path)."""
        lease = self.leases.get(lease_id)
        if lease is not None and lease.state is LeaseState.QUEUED:
            self.queue.remove(self._groups.leader_of(lease_id) or lease_id)

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

    def quarantine_idle(self, gpu_index: int, uuid: str, why: str) -> str | None:
        """Keep the idle MIG instance ``uuid`` from being reused or destroyed: processes run
        on it that no lease explains (found after the lease that held it ended).

        The instance is UNEXPLAINED with ``why``, as :meth:`quarantine` leaves it (an
        instance a resync already made UNEXPLAINED gets ``why`` as its note). Returns its
        name, or ``None`` with nothing changed when it is not an idle, ready instance of
        that GPU: a lease holds it again (its hand-out check decides), it is being made or
        destroyed, or it is gone.
        """
        gpu = self.gpus.get(gpu_index)
        if gpu is None:
            return None
        inst = next((i for i in gpu.instances if i.uuid == uuid), None)
        if inst is None or inst.lease_ids or inst.status is not InstanceStatus.READY:
            return None
        self._touch(gpu_index)
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
            for member in self._groups.stop_waiting(item.payload) or (item.payload,):
                lease = self.leases.get(member)
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
            stale = idle_past(gpu, self.policy.idle_timeout_s, now_s, mono_s)
            work.extend(self.teardown(gpu, stale))
        if work:
            work.extend(self._schedule(now_s, mono_s))
        return self._outcome(work)

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
        return [self._work.new(gpu.index, ops, None, "teardown")]

    def set_draining(self, gpu_index: int, draining: bool, now_s: float, mono_s: float) -> Outcome:
        """Stop (or resume) placing work on a GPU; resuming places what fits there now."""
        self.gpus[gpu_index].draining = draining
        return self._outcome([] if draining else self._schedule(now_s, mono_s))

    # -- introspection ----------------------------------------------------------------------

    def _why_not(self, lease: Lease) -> list[dict[str, Any]]:
        return admission.why_not(lease, self.gpus.values(), self.mode_ops, len(self.queue))

    def active_leases(self) -> list[Lease]:
        return [lease for lease in self.leases.values() if not lease.state.terminal]

    def forget(self, lease_id: str) -> None:
        """Drop one ended lease from memory, with what the queue kept for it."""
        self.leases.pop(lease_id, None)
        self._placed_items.pop(lease_id, None)
        self._groups.forget(lease_id)


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
