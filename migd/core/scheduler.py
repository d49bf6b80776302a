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

Invariants (tested with hypothesis in tests/property/test_scheduler.py):

* an instance with a lease, or with processes migd cannot explain, is never in
  a destroy operation;
* every lease that holds resources points at exactly one instance or share;
* the committed layout of every GPU is a valid state of its state machine.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Literal

from migd.core.demand import DemandKey, DemandModel
from migd.core.geometry import Profile
from migd.core.health import GpuHealth
from migd.core.hybrid import HybridPolicy, Route
from migd.core.leases import LeaseEvent, LeaseState, next_state
from migd.core.mps import (
    DeviceKind,
    MpsPool,
    MpsRequest,
    UserPolicy,
    can_admit,
    clear_waiting,
    client_environment,
    mark_waiting,
    max_clients_for,
)
from migd.core.mps import admit as mps_admit
from migd.core.mps import release as mps_release
from migd.core.planner import (
    CreateOp,
    Decision,
    DestroyOp,
    GpuView,
    Instance,
    Op,
    PartitionRequest,
    PlacementRule,
    PlannerPolicy,
    Sizing,
    never_fits_error,
    plan_on_node,
    size_request,
)
from migd.core.queueing import QueuedRequest, QueuePolicy, RequestQueue
from migd.core.states import StateSpace, describe
from migd.errors import InvalidRequest, MigdError, NoCapacity, RequestTooLarge, UnknownProfile


class GpuMode(StrEnum):
    MIG = "mig"  # migd creates and destroys MIG instances
    MPS = "mps"  # the whole GPU is shared through one MPS daemon
    EXCLUSIVE = "exclusive"  # the whole GPU goes to one job (no MIG, no MPS)
    OFF = "off"  # not managed by migd


class InstanceStatus(StrEnum):
    READY = "ready"
    CREATING = "creating"
    DESTROYING = "destroying"


class Origin(StrEnum):
    MIGD = "migd"  # created by migd (this run or before a restart)
    ADOPTED = "adopted"  # found at start-up, explainable, now managed
    UNEXPLAINED = "unexplained"  # processes without a lease, or not a state of the model


RequestMode = Literal["mig", "mps", "auto"]

#: Compute slices of a GPU without a MIG geometry, for reading ``min_compute`` as an MPS
#: thread percentage: sevenths, the slice of A100/H100-class GPUs.
DEFAULT_COMPUTE_SLICES = 7


@dataclass(frozen=True)
class LeaseRequest:
    """A validated lease request (the API layer builds it)."""

    job_id: str
    memory_mib: int
    slot: str = ""
    min_compute: int = 0
    profile: str | None = None
    mode: RequestMode = "auto"
    gpu_uuids: tuple[str, ...] | None = None  # restrict to these GPUs (prefix match)
    wait_s: float | None = 0.0  # 0: do not queue; None: wait forever
    # MPS: CUDA client processes the job runs (each gets the pinned limit; accounted as
    # memory x clients), and an explicit CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (1-100; else
    # derived from min_compute, see NodeScheduler.mps_thread_percentage).
    mps_clients: int = 1
    mps_thread_percentage: int | None = None

    def __post_init__(self) -> None:
        if self.memory_mib <= 0 and not self.profile:
            raise InvalidRequest(
                "a lease needs gpu_memory_mib > 0 or a profile",
                hint="ask for the GPU memory the job needs, e.g. request_VRAM = 10240",
            )
        if self.min_compute < 0:
            raise InvalidRequest("min_compute must not be negative")
        if self.wait_s is not None and self.wait_s < 0:
            raise InvalidRequest("wait_s must not be negative")
        if self.mps_clients < 1:
            raise InvalidRequest(
                f"mps_clients must be at least 1, got {self.mps_clients}",
                hint="declare how many CUDA processes the job runs (default 1)",
            )
        if self.mps_thread_percentage is not None and not 1 <= self.mps_thread_percentage <= 100:
            raise InvalidRequest(
                f"mps_thread_percentage must be 1-100, got {self.mps_thread_percentage}"
            )


@dataclass
class Lease:
    """One job's claim on a partition, from request to release."""

    lease_id: str
    request: LeaseRequest
    owner_uid: int
    owner_pid: int
    created_s: float
    owner_start_s: float | None = None
    state: LeaseState = LeaseState.QUEUED
    updated_s: float = 0.0
    gpu: int | None = None
    gpu_uuid: str | None = None
    mode: GpuMode | None = None  # granted: MIG, MPS or EXCLUSIVE (never OFF)
    profile: str | None = None
    start: int | None = None
    mig_uuid: str | None = None
    memory_limit_mib: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    decision: dict[str, Any] | None = None
    reason: str = ""
    heartbeat_s: float | None = None
    deadline_s: float | None = None  # wall clock, for display
    version: int = 0  # bumped on every change, so callers persist only what changed
    # MPS: the CUDA_MPS_ACTIVE_THREAD_PERCENTAGE granted (explicit or from min_compute).
    mps_thread_percentage: int | None = None
    # Something that hit the lease while it was active and that its job should know
    # (e.g. its MPS server was restarted, so its CUDA clients died); shown by migctl.
    warning: str = ""
    warning_s: float | None = None

    def __post_init__(self) -> None:
        if self.mode is not None:  # the state db and JSON give the value
            self.mode = GpuMode(self.mode)

    @property
    def mps_device_uuid(self) -> str | None:
        """The MPS device an ``mps`` lease runs on: its MIG instance (MPS inside MIG) or
        its whole GPU."""
        if self.mode is not GpuMode.MPS:
            return None
        return self.mig_uuid or self.gpu_uuid

    def warn(self, message: str, now_s: float) -> None:
        """Flag the lease (kept while it lives and in its record)."""
        self.warning, self.warning_s = message, now_s
        self.version += 1

    def event(self, event: LeaseEvent, now_s: float, reason: str = "") -> None:
        self.state = next_state(self.state, event)
        self.updated_s = now_s
        self.version += 1
        if reason:
            self.reason = reason

    def to_dict(self) -> dict[str, Any]:
        return {
            "lease_id": self.lease_id,
            "job_id": self.request.job_id,
            "slot": self.request.slot,
            "state": self.state.value,
            "owner_uid": self.owner_uid,
            "owner_pid": self.owner_pid,
            "requested_mib": self.request.memory_mib,
            "min_compute": self.request.min_compute,
            "requested_mode": self.request.mode,
            "mode": self.mode,
            "gpu": self.gpu,
            "gpu_uuid": self.gpu_uuid,
            "profile": self.profile,
            "start": self.start,
            "mig_uuid": self.mig_uuid,
            "memory_limit_mib": self.memory_limit_mib,
            "mps_clients": self.request.mps_clients,
            "mps_thread_percentage": self.mps_thread_percentage,
            "warning": self.warning,
            "warning_s": self.warning_s,
            "env": dict(self.env),
            "created_s": self.created_s,
            "updated_s": self.updated_s,
            "deadline_s": self.deadline_s,
            "reason": self.reason,
            "decision": self.decision,
        }


@dataclass
class ManagedInstance:
    """A MIG instance migd tracks on one GPU."""

    profile: Profile
    start: int
    memory_mib: int
    gi_id: int | None = None
    uuid: str | None = None
    status: InstanceStatus = InstanceStatus.READY
    origin: Origin = Origin.MIGD
    lease_id: str | None = None
    idle_since_s: float | None = None
    used_mib: int | None = None
    note: str = ""
    # MPS inside MIG: the instance hosts an MPS daemon whose shares are these (no
    # lease_id then: many leases share it).
    mps_pool: MpsPool | None = None

    @property
    def busy(self) -> bool:
        """Planner view: anything but an idle, ready, explained instance is untouchable."""
        return (
            self.lease_id is not None
            or self.status is not InstanceStatus.READY
            or self.origin is Origin.UNEXPLAINED
            or (self.mps_pool is not None and bool(self.mps_pool.shares))
        )

    def __str__(self) -> str:
        return f"{self.profile.name}@{self.start}"


@dataclass
class ManagedGpu:
    """One GPU as the scheduler sees it."""

    index: int
    uuid: str
    model: str
    name: str
    memory_total_mib: int
    mode: GpuMode
    space: StateSpace | None = None
    instances: list[ManagedInstance] = field(default_factory=list)
    draining: bool = False
    #: Conditions that keep new work off the GPU, each owned by its source (core.health).
    health: GpuHealth = field(default_factory=GpuHealth)
    exclusive_lease: str | None = None  # EXCLUSIVE-mode bookkeeping
    mps_pool: MpsPool | None = None  # MPS-mode accounting (migd.core.mps)
    used_mib: int | None = None
    # MIG GPUs: small and mode=mps requests get an MPS share inside an instance of
    # mps_profile (default: the smallest profile) that migd creates for MPS.
    mps_in_mig: bool = False
    mps_profile: str | None = None
    # Compute slices of the whole GPU (MIG geometry, also known for MPS-mode GPUs of MIG
    # models); None when the model has none. min_compute is read against it.
    compute_slices: int | None = None

    @property
    def mps_shares(self) -> dict[str, int]:
        """Lease id -> pinned MiB per client, for status output."""
        return {s.share_id: s.memory_mib for s in self.mps_pool.shares} if self.mps_pool else {}

    @property
    def available(self) -> bool:
        return not self.draining and self.health.available

    def instance_at(
        self, start: int, status: InstanceStatus | None = None
    ) -> ManagedInstance | None:
        """The instance at ``start`` (with ``status``, if given).

        During a repartition an instance being destroyed and its replacement being
        created can share a start, so callers that act on one of them name its status.
        """
        for inst in self.instances:
            if inst.start == start and (status is None or inst.status is status):
                return inst
        return None

    def instance_of(self, lease_id: str) -> ManagedInstance | None:
        for inst in self.instances:
            if inst.lease_id == lease_id:
                return inst
        return None

    def view(self) -> GpuView:
        assert self.space is not None
        reason = (
            "draining" if self.draining else ("" if self.health.available else str(self.health))
        )
        return GpuView(
            index=self.index,
            space=self.space,
            # Instances being destroyed are already gone from the intended layout: work on a
            # GPU runs in order, so a later plan may reuse their slices.
            # An MPS host (even with no share now) is kept for MPS: plain MIG requests
            # neither reuse nor repartition it; idle teardown still removes it.
            instances=tuple(
                Instance(i.profile, i.start, i.busy or i.mps_pool is not None, f"gi:{i.gi_id}")
                for i in self.instances
                if i.status is not InstanceStatus.DESTROYING
            ),
            available=self.available,
            unavailable_reason=reason,
        )


@dataclass(frozen=True)
class Work:
    """NVML work the caller must execute, in order, on one GPU."""

    gpu: int
    ops: tuple[Op, ...]
    lease_id: str | None = None  # lease that becomes ACTIVE when the work is done
    kind: Literal["grant", "teardown"] = "grant"
    work_id: int = 0


@dataclass
class SchedulerPolicy:
    planner: PlannerPolicy = field(default_factory=PlannerPolicy)
    queue: QueuePolicy = QueuePolicy.FIFO
    aging_s: float = 600.0
    starvation_s: float = 1800.0
    backfill: bool | None = None
    idle_policy: Literal["keep", "destroy", "timeout"] = "timeout"
    idle_timeout_s: float = 300.0
    demand_weighting: bool = False
    demand_prior: Mapping[DemandKey, float] = field(default_factory=dict)  # (model, ID)
    demand_half_life_s: float = 24 * 3600.0
    mps_reserve_mib: int = 1024
    mps_max_clients: int = 48
    mps_multi_user: bool = False
    # GPUs with mps_in_mig: the hybrid policy decides per request whether it shares and
    # sizes new MPS hosts (migd.core.hybrid); None: the fixed mps_profile rule.
    hybrid: HybridPolicy | None = None


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
        # Leases changed by the mutation in progress, with their state before it.
        self._changed: dict[str, tuple[Lease, LeaseState | None]] = {}

    def _new_queue(self) -> RequestQueue[str]:
        return RequestQueue(
            policy=self.policy.queue,
            aging_s=self.policy.aging_s,
            starvation_s=self.policy.starvation_s,
            backfill=self.policy.backfill,
        )

    def _event(self, lease: Lease, event: LeaseEvent, now_s: float, reason: str = "") -> None:
        """Every state change goes through here (and the transition table)."""
        self._changed.setdefault(lease.lease_id, (lease, lease.state))
        lease.event(event, now_s, reason)

    def _outcome(self, work: list[Work] | None = None, **fields: Any) -> Outcome:
        """The mutation's outcome: its work and the leases' net state changes."""
        transitions = [
            Transition(lease, old, lease.state)
            for lease, old in self._changed.values()
            if lease.state is not old
        ]
        self._changed.clear()
        return Outcome(work=work or [], transitions=transitions, **fields)

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
        if request.mode == "mig":
            gpus = [g for g in gpus if g.mode is GpuMode.MIG]
        elif request.mode == "mps":
            gpus = [
                g for g in gpus if g.mode is GpuMode.MPS or (g.mode is GpuMode.MIG and g.mps_in_mig)
            ]
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
        request = lease.request
        partition = _partition_request(request)
        sizes: dict[str, Profile] = {}
        sizings: list[tuple[StateSpace, Sizing]] = []
        others: list[str] = []
        largest = 0
        fits = False
        for g in gpus:
            if g.mode is GpuMode.MIG and g.space is not None:
                if request.mode == "mps":  # only an MPS share inside an instance will do
                    host = self._mps_host_profile(g)
                    capacity = max(0, host.memory_mib - self.policy.mps_reserve_mib)
                    largest = max(largest, capacity)
                    if request.memory_mib * request.mps_clients <= capacity:
                        fits = True
                    else:
                        others.append(
                            f"{request.memory_mib} MiB x {request.mps_clients} client(s) is "
                            f"more than an MPS share in GPU {g.index}'s {host.name} can hold "
                            f"({capacity} MiB)"
                        )
                    continue
                sizing = size_request(g.space, partition)
                if sizing.profile is not None:
                    sizes.setdefault(g.space.geometry.model, sizing.profile)
                    fits = True
                else:
                    sizings.append((g.space, sizing))
            elif g.mode is GpuMode.MPS:
                pool = self.mps_pool(g)
                largest = max(largest, pool.capacity_mib)
                need_mib = request.memory_mib * request.mps_clients
                if need_mib <= pool.capacity_mib and request.mps_clients <= pool.max_clients:
                    fits = True
                elif request.mps_clients > pool.max_clients:
                    others.append(
                        f"{request.mps_clients} MPS clients are more than GPU {g.index} "
                        f"serves ({pool.max_clients})"
                    )
                else:
                    others.append(
                        f"{need_mib} MiB is more than GPU {g.index}'s MPS capacity "
                        f"({pool.capacity_mib} MiB)"
                    )
            elif g.mode is GpuMode.EXCLUSIVE:
                largest = max(largest, g.memory_total_mib)
                if request.memory_mib <= g.memory_total_mib:
                    fits = True
                else:
                    others.append(
                        f"{request.memory_mib} MiB is more than GPU {g.index}'s "
                        f"{g.memory_total_mib} MiB"
                    )
        if not fits:
            raise never_fits_error(partition, sizings, others, largest)
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
            if gpu.mps_pool is not None and gpu.mps_pool.draining_for_uid is not None:
                gpu.mps_pool = clear_waiting(gpu.mps_pool)
            for inst in gpu.instances:
                if inst.mps_pool is not None and inst.mps_pool.draining_for_uid is not None:
                    inst.mps_pool = clear_waiting(inst.mps_pool)
        # Within one pass nothing is released, so a request that sizes like one that did
        # not fit will not fit either: a long size-ordered queue costs one plan per
        # distinct partition size, not one per queued job or per distinct MiB figure.
        failed: set[Hashable] = set()
        # Hybrid: MPS admission depends on the user and on MiB, monotonically: a user's
        # request of this shape that needs at least as much as one refused in this pass
        # is refused too (least refused MiB per (uid, shape)).
        refused_mib: dict[Hashable, int] = {}

        def try_place(item: QueuedRequest[str]) -> bool:
            lease = self.leases.get(item.payload)
            if lease is None or lease.state is not LeaseState.QUEUED:
                return True  # stale entry: drop it
            shape = None if self._mps_capable(lease) else self._placement_shape(lease.request)
            if shape is not None and shape in failed:
                return False
            share_key: Hashable = None
            need = lease.request.memory_mib * lease.request.mps_clients
            if shape is None and self.policy.hybrid is not None:
                share_key = (lease.owner_uid, self._placement_shape(lease.request))
                if need >= refused_mib.get(share_key, math.inf):
                    return False
            placed = self._place(lease, now_s)
            if placed is None:
                if shape is not None:
                    failed.add(shape)
                if share_key is not None:
                    refused_mib[share_key] = min(need, refused_mib.get(share_key, need))
                return False
            if placed.ops:
                # kept until its work is done or fails (a failure puts it back in place)
                self._placed_items[lease.lease_id] = item
                work.append(placed)
            return True

        self.queue.schedule(mono_s, try_place)
        return work

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
        partition = _partition_request(request)
        sizes: dict[str, int | None] = {}
        exclusive = False
        for g in gpus:
            if g.mode is GpuMode.MIG and g.space is not None:
                model = g.space.geometry.model
                if model not in sizes:
                    prof = size_request(g.space, partition).profile
                    sizes[model] = prof.profile_id if prof is not None else None
            elif g.mode is GpuMode.EXCLUSIVE:
                exclusive = True
        return (
            request.mode,
            request.gpu_uuids,
            tuple(sorted(sizes.items())),
            request.memory_mib if exclusive else None,
        )

    def _mps_capable(self, lease: Lease) -> bool:
        """MPS admission depends on the requester's uid, not only on the request's shape."""
        return lease.request.mode != "mig" and any(
            g.mode is GpuMode.MPS or g.mps_in_mig for g in self.gpus.values()
        )

    def _place(self, lease: Lease, now_s: float) -> Work | None:
        """Place one lease now, or return None. Commits the decision on success."""
        request = lease.request
        try:
            gpus = self._candidate_gpus(request)
        except InvalidRequest:
            return None
        mig = [g for g in gpus if g.mode is GpuMode.MIG and g.space is not None]
        hosts = [g for g in mig if self._mps_in_mig_for(g, request)]
        if hosts:
            placed = self._place_mps_in_mig(lease, hosts, now_s)
            if placed is not None:
                self._explain_hybrid(lease, hosts[0])
                return placed
        if request.mode == "mps":
            mig = []  # an MPS request never takes a MIG instance of its own
        if mig:
            planner = self.policy.planner
            if self.policy.demand_weighting:
                weights = self.demand.weights(now_s)
                if weights:
                    planner = replace(planner, placement=PlacementRule.WEIGHTED, demand=weights)
            try:
                decision = plan_on_node(
                    [g.view() for g in mig], _partition_request(request), planner
                )
            except (NoCapacity, RequestTooLarge, UnknownProfile):
                decision = None  # the MIG GPUs cannot take it: MPS or a whole GPU may
            if decision is not None:
                work = self._commit_mig(lease, decision, now_s)
                self._explain_hybrid(lease, self.gpus[decision.gpu])
                return work
        for g in gpus:
            if g.mode is GpuMode.MPS and g.available and self._mps_admits(g, lease):
                return self._commit_mps(lease, g, now_s)
        for g in gpus:
            if (
                g.mode is GpuMode.EXCLUSIVE
                and g.available
                and g.exclusive_lease is None
                and request.memory_mib <= g.memory_total_mib
            ):
                return self._commit_exclusive(lease, g, now_s)
        return None

    def _take_partition(
        self, gpu: ManagedGpu, decision: Decision, lease_id: str, owner: str | None
    ) -> tuple[ManagedInstance, Work]:
        """Carry ``decision`` out in the books: the idle instances it destroys are being
        destroyed, and the instance it grants is reused (no NVML work) or being created
        for ``owner`` (its work pending until :meth:`work_done`)."""
        for op in decision.ops:
            if isinstance(op, DestroyOp):
                victim = gpu.instance_at(op.start, InstanceStatus.READY)
                assert victim is not None and not victim.busy, "planner chose a busy instance"
                victim.status = InstanceStatus.DESTROYING
        if decision.action == "reuse":
            inst = gpu.instance_at(decision.start, InstanceStatus.READY)
            assert inst is not None
            return inst, Work(gpu.index, (), lease_id, "grant", next(self._work_ids))
        inst = ManagedInstance(
            profile=decision.profile,
            start=decision.start,
            memory_mib=decision.profile.memory_mib,
            status=InstanceStatus.CREATING,
            lease_id=owner,
        )
        gpu.instances.append(inst)
        work = Work(gpu.index, decision.ops, lease_id, "grant", next(self._work_ids))
        self._pending_work[work.work_id] = work
        return inst, work

    def _commit_mig(self, lease: Lease, decision: Decision, now_s: float) -> Work:
        gpu = self.gpus[decision.gpu]
        inst, work = self._take_partition(gpu, decision, lease.lease_id, lease.lease_id)
        self._event(lease, LeaseEvent.PLAN, now_s)
        lease.gpu, lease.gpu_uuid, lease.mode = gpu.index, gpu.uuid, GpuMode.MIG
        lease.profile, lease.start = decision.profile.name, decision.start
        lease.memory_limit_mib = decision.profile.memory_mib
        lease.decision = decision.to_dict()
        if decision.action == "reuse":
            inst.lease_id, inst.idle_since_s = lease.lease_id, None
            self._activate_mig(lease, inst, now_s)
        return work

    def _activate_mig(self, lease: Lease, inst: ManagedInstance, now_s: float) -> None:
        lease.mig_uuid = inst.uuid
        lease.memory_limit_mib = inst.memory_mib
        uuid = inst.uuid or ""
        lease.env = {"CUDA_VISIBLE_DEVICES": uuid, "NVIDIA_VISIBLE_DEVICES": uuid}
        self._event(lease, LeaseEvent.READY, now_s)
        lease.heartbeat_s = now_s

    def mps_pool(self, gpu: ManagedGpu) -> MpsPool:
        """The GPU's MPS accounting, created on first use from the policy."""
        if gpu.mps_pool is None:
            gpu.mps_pool = MpsPool(
                device_uuid=gpu.uuid,
                memory_total_mib=gpu.memory_total_mib,
                reserve_mib=self.policy.mps_reserve_mib,
                max_clients=self.policy.mps_max_clients,
                policy=UserPolicy.MULTI_USER if self.policy.mps_multi_user else UserPolicy.PER_USER,
            )
        return gpu.mps_pool

    @staticmethod
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

    def _mps_request(self, lease: Lease, compute_slices: int | None) -> MpsRequest:
        request = lease.request
        return MpsRequest(
            lease.lease_id,
            lease.owner_uid,
            request.memory_mib,
            clients=request.mps_clients,
            thread_percentage=self.mps_thread_percentage(request, compute_slices),
        )

    def _mps_admits(self, gpu: ManagedGpu, lease: Lease) -> bool:
        pool = self.mps_pool(gpu)
        try:
            answer = can_admit(pool, self._mps_request(lease, gpu.compute_slices))
        except RequestTooLarge:
            return False
        if not answer.ok and answer.waiting_for_uid is not None:
            # One MPS server serves one UID at a time: let the device drain for this user
            # so a stream of the current user's jobs cannot starve it.
            gpu.mps_pool = mark_waiting(pool, lease.owner_uid)
        return answer.ok

    def _commit_mps(self, lease: Lease, gpu: ManagedGpu, now_s: float) -> Work:
        self._event(lease, LeaseEvent.PLAN, now_s)
        share = self._mps_request(lease, gpu.compute_slices)
        gpu.mps_pool = mps_admit(self.mps_pool(gpu), share)
        lease.gpu, lease.gpu_uuid, lease.mode = gpu.index, gpu.uuid, GpuMode.MPS
        lease.memory_limit_mib = lease.request.memory_mib
        lease.mps_thread_percentage = share.thread_percentage
        lease.decision = {
            "action": "mps-share",
            "gpu": gpu.index,
            "pinned_mib": lease.request.memory_mib,
            "shares_after": len(gpu.mps_pool.shares),
            "reason": f"GPU {gpu.index}: MPS share of {lease.request.memory_mib} MiB "
            f"({gpu.mps_pool.free_mib} MiB left unpinned)",
        }
        lease.env = self._mps_env(gpu, lease)
        self._event(lease, LeaseEvent.READY, now_s)
        lease.heartbeat_s = now_s
        return Work(gpu.index, (), lease.lease_id, "grant", next(self._work_ids))

    # -- MPS inside MIG ----------------------------------------------------------------------

    def _mps_host_profile(self, gpu: ManagedGpu) -> Profile:
        """The profile of the instances migd makes to host MPS on ``gpu``."""
        assert gpu.space is not None
        if gpu.mps_profile:
            return gpu.space.member(gpu.mps_profile)
        return min(gpu.space.profiles, key=lambda p: (p.memory_mib, p.compute_slices))

    def _mps_in_mig_for(self, gpu: ManagedGpu, request: LeaseRequest) -> bool:
        """Whether ``request`` goes to an MPS share inside a MIG instance of ``gpu``:
        the GPU is configured for it, and the request asks for MPS or is smaller than
        the smallest instance (and names no profile)."""
        if not gpu.mps_in_mig or gpu.space is None or request.mode == "mig" or request.profile:
            return False
        if self.policy.hybrid is not None:
            return self._hybrid_route(gpu, request).share
        if request.mode == "mps":
            return True
        smallest = min(p.memory_mib for p in gpu.space.profiles)
        return request.memory_mib < smallest

    # -- the hybrid policy's hook (migd.core.hybrid decides; this only asks and records) --

    def _hybrid_route(self, gpu: ManagedGpu, request: LeaseRequest) -> Route:
        assert self.policy.hybrid is not None and gpu.space is not None
        return self.policy.hybrid.route(
            gpu.space.profiles,
            request.memory_mib * request.mps_clients,
            request.min_compute,
            request.mode,
            bool(request.profile),
        )

    def _host_profiles(self, gpu: ManagedGpu, lease: Lease) -> tuple[tuple[Profile, ...], str]:
        """Profiles for a new MPS host on ``gpu``, best first, and why."""
        if self.policy.hybrid is None or gpu.space is None:
            return (self._mps_host_profile(gpu),), ""
        need = lease.request.memory_mib * lease.request.mps_clients
        demand = need
        for other_gpu in self.gpus.values():  # observed demand: what this user pins in hosts
            for inst in other_gpu.instances:
                if inst.mps_pool is not None:
                    demand += sum(
                        s.memory_mib * s.clients
                        for s in inst.mps_pool.shares
                        if s.uid == lease.owner_uid
                    )
        for item in self.queue:  # and this user's share-bound backlog
            other = self.leases.get(item.payload)
            if (
                other is not None
                and other is not lease
                and other.owner_uid == lease.owner_uid
                and other.state is LeaseState.QUEUED
                and self._hybrid_route(gpu, other.request).share
            ):
                demand += other.request.memory_mib * other.request.mps_clients
        return self.policy.hybrid.host_profiles(
            gpu.space.profiles, need, demand, lease.request.min_compute
        )

    def _explain_hybrid(self, lease: Lease, gpu: ManagedGpu) -> None:
        """Put the hybrid's reason first in the lease's decision (migctl explain)."""
        if self.policy.hybrid is None or not gpu.mps_in_mig or lease.decision is None:
            return
        why = self._hybrid_route(gpu, lease.request).reason
        host = lease.decision.pop("host_reason", "")
        lease.decision["hybrid"] = why + (f"; {host}" if host else "")
        lease.decision["reason"] = f"hybrid: {lease.decision['hybrid']}. " + str(
            lease.decision.get("reason", "")
        )

    def _new_host_pool(
        self, gpu: ManagedGpu, profile: Profile, uuid: str | None, memory_mib: int | None = None
    ) -> MpsPool:
        """An MPS host's pool: as large as NVML says its MIG device is (``memory_mib``, an
        existing instance's), else the profile's nominal size until it exists."""
        assert gpu.space is not None
        return MpsPool(
            device_uuid=uuid or f"{gpu.uuid}/{profile.name}",
            memory_total_mib=memory_mib or profile.memory_mib,
            reserve_mib=self.policy.mps_reserve_mib,
            max_clients=max_clients_for(
                self.policy.mps_max_clients,
                compute_slices=profile.compute_slices,
                total_compute_slices=gpu.space.geometry.compute_slices,
            ),
            policy=UserPolicy.MULTI_USER if self.policy.mps_multi_user else UserPolicy.PER_USER,
            kind=DeviceKind.MIG,
        )

    def _host_request(self, lease: Lease, inst: ManagedInstance) -> MpsRequest | None:
        """The share on host ``inst``; None when its compute instance is too small."""
        if lease.request.min_compute > inst.profile.compute_slices:
            return None
        return self._mps_request(lease, inst.profile.compute_slices)

    def _place_mps_in_mig(
        self, lease: Lease, gpus: Sequence[ManagedGpu], now_s: float
    ) -> Work | None:
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
                share = self._host_request(lease, inst)
                if share is None:
                    continue
                try:
                    answer = can_admit(pool, share)
                except RequestTooLarge:
                    continue
                if answer.ok:
                    return self._commit_mps_in_mig(lease, gpu, inst, share, None, now_s)
                if answer.waiting_for_uid is not None:
                    refused.append((gpu, inst, lease.owner_uid))
        work = self._new_mps_host(lease, [g for g in gpus if g.available], now_s)
        if work is None:
            # No room for another host: the user waits for one, and drains it.
            for _gpu, inst, uid in refused[:1]:
                assert inst.mps_pool is not None
                inst.mps_pool = mark_waiting(inst.mps_pool, uid)
        return work

    def _new_mps_host(self, lease: Lease, gpus: Sequence[ManagedGpu], now_s: float) -> Work | None:
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
            probe = ManagedInstance(profile=profile, start=-1, memory_mib=profile.memory_mib)
            share = self._host_request(lease, probe)
            if share is None:
                continue
            try:
                can_admit(self._new_host_pool(group[0], profile, None), share)
            except RequestTooLarge:
                continue
            try:
                decision = plan_on_node(
                    [g.view() for g in group],
                    PartitionRequest(memory_mib=profile.memory_mib, profile=name),
                    self.policy.planner,
                )
            except (NoCapacity, RequestTooLarge):
                continue
            gpu = self.gpus[decision.gpu]
            work = self._commit_mps_in_mig(lease, gpu, None, share, decision, now_s)
            if why[name] and lease.decision is not None:
                lease.decision["host_reason"] = why[name]
            return work
        return None

    def _commit_mps_in_mig(
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
        ready host, else when its creation is done (:meth:`work_done`)."""
        action = "mps-share"
        if inst is None:
            assert decision is not None
            # A host belongs to no lease (many share it): created with no owner.
            inst, work = self._take_partition(gpu, decision, lease.lease_id, None)
            action = f"mps-host-{decision.action}"
            inst.mps_pool = self._new_host_pool(gpu, inst.profile, inst.uuid, inst.memory_mib)
            # A new MPS host is demand for its profile, like a request sized to it.
            assert gpu.space is not None
            self.demand.observe(gpu.space.geometry.model, decision.profile.profile_id, now_s)
        else:
            work = Work(gpu.index, (), lease.lease_id, "grant", next(self._work_ids))
        assert inst.mps_pool is not None
        inst.mps_pool = mps_admit(inst.mps_pool, share)
        inst.idle_since_s = None
        self._event(lease, LeaseEvent.PLAN, now_s)
        lease.gpu, lease.gpu_uuid, lease.mode = gpu.index, gpu.uuid, GpuMode.MPS
        lease.profile, lease.start = inst.profile.name, inst.start
        lease.memory_limit_mib = share.memory_mib
        lease.mps_thread_percentage = share.thread_percentage
        pool = inst.mps_pool
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
            self._activate_mps_share(lease, gpu, inst, now_s)
        return work

    def _activate_mps_share(
        self, lease: Lease, gpu: ManagedGpu, inst: ManagedInstance, now_s: float
    ) -> None:
        lease.mig_uuid = inst.uuid
        lease.env = self._mps_env(gpu, lease)
        self._event(lease, LeaseEvent.READY, now_s)
        lease.heartbeat_s = now_s

    def _leases_on(self, inst: ManagedInstance) -> list[Lease]:
        """The leases an instance serves: its own, or the shares of an MPS host."""
        ids = [inst.lease_id] if inst.lease_id else []
        if inst.mps_pool is not None:
            ids += [s.share_id for s in inst.mps_pool.shares]
        return [self.leases[i] for i in ids if i in self.leases]

    def _host_of(self, gpu: ManagedGpu, lease_id: str) -> ManagedInstance | None:
        for inst in gpu.instances:
            if inst.mps_pool is not None and inst.mps_pool.share(lease_id) is not None:
                return inst
        return None

    def _release_mps(self, gpu: ManagedGpu, lease: Lease, now_s: float) -> list[Work]:
        """Drop an MPS lease's share: from its GPU's pool or its MIG host's."""
        if gpu.mps_pool is not None and gpu.mps_pool.share(lease.lease_id) is not None:
            gpu.mps_pool = mps_release(gpu.mps_pool, lease.lease_id)
            return []
        inst = self._host_of(gpu, lease.lease_id)
        if inst is None or inst.mps_pool is None:
            return []
        inst.mps_pool = mps_release(inst.mps_pool, lease.lease_id)
        if inst.mps_pool.shares or inst.status is not InstanceStatus.READY:
            return []
        inst.idle_since_s = now_s
        hybrid = self.policy.hybrid is not None
        if (
            hybrid or self.policy.idle_policy == "destroy"
        ) and inst.origin is not Origin.UNEXPLAINED:
            # The hybrid shrinks hosts when idle: an empty host is destroyed at once (the
            # daemon stops its MPS server first), so its slices are free for any size. It
            # is never handed to a MIG lease as it is: its server may still hold the device.
            return self._teardown(gpu, [inst])
        return []

    def _commit_exclusive(self, lease: Lease, gpu: ManagedGpu, now_s: float) -> Work:
        self._event(lease, LeaseEvent.PLAN, now_s)
        gpu.exclusive_lease = lease.lease_id
        lease.gpu, lease.gpu_uuid, lease.mode = gpu.index, gpu.uuid, GpuMode.EXCLUSIVE
        lease.memory_limit_mib = gpu.memory_total_mib
        lease.env = {"CUDA_VISIBLE_DEVICES": gpu.uuid, "NVIDIA_VISIBLE_DEVICES": gpu.uuid}
        lease.decision = {"action": "exclusive", "gpu": gpu.index, "reason": "whole GPU"}
        self._event(lease, LeaseEvent.READY, now_s)
        lease.heartbeat_s = now_s
        return Work(gpu.index, (), lease.lease_id, "grant", next(self._work_ids))

    # -- work results -----------------------------------------------------------------------

    def work_is_current(self, work: Work) -> bool:
        """False for work a failure made obsolete; the caller must not execute it."""
        return work.work_id not in self._stale_work

    def work_done(
        self,
        work: Work,
        created: Mapping[int, tuple[int | None, str | None, int]],
        now_s: float,
        mono_s: float,
    ) -> Outcome:
        """Record finished work. ``created`` maps start -> (gi_id, mig_uuid, memory_mib).

        The outcome has the grants it completes and the queued requests that now fit.
        """
        self._work_done(work, created, now_s)
        return self._outcome(self._schedule(now_s, mono_s))

    def _work_done(
        self, work: Work, created: Mapping[int, tuple[int | None, str | None, int]], now_s: float
    ) -> None:
        if work.work_id in self._stale_work:
            self._stale_work.discard(work.work_id)
            return
        self._pending_work.pop(work.work_id, None)
        if work.lease_id:
            self._placed_items.pop(work.lease_id, None)
        gpu = self.gpus[work.gpu]
        for op in work.ops:
            if isinstance(op, DestroyOp):
                gpu.instances = [
                    i
                    for i in gpu.instances
                    if not (i.start == op.start and i.status is InstanceStatus.DESTROYING)
                ]
        for op in work.ops:
            if isinstance(op, CreateOp):
                inst = gpu.instance_at(op.start, InstanceStatus.CREATING)
                assert inst is not None
                gi_id, uuid, memory = created[op.start]
                inst.gi_id, inst.uuid, inst.memory_mib = gi_id, uuid, memory
                inst.status = InstanceStatus.READY
                if inst.mps_pool is not None:  # an MPS host: its shares' leases go active
                    # The pool holds what NVML reports for the new MIG device, not the
                    # profile's nominal size (issue 13, defect 7).
                    inst.mps_pool = replace(
                        inst.mps_pool, device_uuid=uuid or "", memory_total_mib=memory
                    )
                    for waiting in self._leases_on(inst):
                        if waiting.state is LeaseState.PREPARING:
                            self._activate_mps_share(waiting, gpu, inst, now_s)
                    if not inst.mps_pool.shares:
                        inst.idle_since_s = now_s
                    continue
                lease = self.leases.get(inst.lease_id or "")
                if lease is not None and lease.state is LeaseState.PREPARING:
                    self._activate_mig(lease, inst, now_s)
                else:  # the lease was cancelled while we were creating: now idle
                    inst.lease_id, inst.idle_since_s = None, now_s

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
        gpu = self.gpus[work.gpu]
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
                    gpu.instances.remove(inst)
                    for waiting in self._leases_on(inst):  # an MPS host's other shares
                        self._retry(waiting, f"placement failed: {error}", now_s)
        self._retry(self.leases.get(work.lease_id or ""), f"placement failed: {error}", now_s)
        for inst in restored:
            units = inst.profile.units_mask(inst.start)
            for other in [
                o
                for o in gpu.instances
                if o.status is InstanceStatus.CREATING and o.profile.units_mask(o.start) & units
            ]:
                gpu.instances.remove(other)
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

    def _retry(self, lease: Lease | None, reason: str, now_s: float) -> None:
        """Send a lease whose placement fell through back to the queue, keeping its place."""
        if lease is None:
            return
        item = self._placed_items.pop(lease.lease_id, None)
        if lease.state is not LeaseState.PREPARING:  # released meanwhile: nothing to retry
            return
        lease.gpu = lease.gpu_uuid = lease.profile = lease.start = None
        lease.memory_limit_mib = None
        self._event(lease, LeaseEvent.RETRY, now_s, reason=reason)
        if item is not None:
            self.queue.restore(item)

    def resync(
        self,
        gpu_index: int,
        observed: Iterable[tuple[Profile, int, int | None, str | None, int]],
        busy_uuids: set[str],
        now_s: float,
    ) -> Outcome:
        """Make a GPU's bookkeeping match what the backend reports.

        ``observed`` holds ``(profile, start, gi_id, mig_uuid, memory_mib)`` per instance.
        Instances we know keep their lease; new ones are adopted (idle) unless processes
        run on them without a lease, which makes them UNEXPLAINED: reported, never
        destroyed. The outcome's notes say what changed, in words; leases of instances
        that disappeared are reclaimed. No scheduling pass: the caller runs
        :meth:`schedule` once it has judged the GPU (see the daemon's reconciler).
        """
        gpu = self.gpus[gpu_index]
        assert gpu.space is not None
        notes: list[str] = []
        known = {i.start: i for i in gpu.instances}
        fresh: list[ManagedInstance] = []
        for profile, start, gi_id, uuid, memory in observed:
            inst = known.pop(start, None)
            if inst is not None and inst.profile.profile_id == profile.profile_id:
                inst.gi_id, inst.uuid, inst.memory_mib = gi_id, uuid, memory
                if inst.status is not InstanceStatus.CREATING:
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
            notes.append(f"{gone} disappeared")
            for lease in self._leases_on(gone):
                if lease.state.holds_resources:
                    self._event(
                        lease, LeaseEvent.RECLAIM, now_s, reason=f"instance {gone} disappeared"
                    )
        gpu.instances = sorted(fresh, key=lambda i: i.start)
        # The committed layout must stay a valid state; a layout that is not is reported.
        try:
            gpu.space.key_of((i.profile, i.start) for i in gpu.instances)
        except Exception as exc:
            reason = f"layout not understood: {exc}"
            gpu.health.raise_("resync", reason, now_s)  # cleared by the next resync
            notes.append(reason)
        return self._outcome(notes=notes)

    # -- release, reclaim, expiry, idle teardown --------------------------------------------

    def release(
        self, lease_id: str, now_s: float, mono_s: float, *, reclaim: bool = False, reason: str = ""
    ) -> Outcome:
        """End a lease (released by its owner, or reclaimed because the holder died).

        The outcome's work: teardown of the freed instance when the idle policy says so,
        and grants for queued requests that now fit.
        """
        lease = self.leases[lease_id]
        if lease.state.terminal:
            return self._outcome()
        event = LeaseEvent.RECLAIM if reclaim else LeaseEvent.RELEASE
        was = lease.state
        self._event(lease, event, now_s, reason=reason or ("reclaimed" if reclaim else "released"))
        self.queue.remove(lease_id)
        work: list[Work] = []
        if was.holds_resources and lease.gpu is not None:
            gpu = self.gpus[lease.gpu]
            if lease.mode is GpuMode.MIG:
                inst = gpu.instance_of(lease_id)
                if inst is not None:
                    # A CREATING instance stays untouchable by its status; work_done then
                    # finds no owner and marks it idle.
                    inst.lease_id = None
                    if inst.status is InstanceStatus.READY:
                        inst.idle_since_s = now_s
                        if (
                            self.policy.idle_policy == "destroy"
                            and inst.origin is not Origin.UNEXPLAINED
                        ):
                            work.extend(self._teardown(gpu, [inst]))
            elif lease.mode is GpuMode.MPS:
                work.extend(self._release_mps(gpu, lease, now_s))
            elif lease.mode is GpuMode.EXCLUSIVE and gpu.exclusive_lease == lease_id:
                gpu.exclusive_lease = None
        work.extend(self._schedule(now_s, mono_s))
        return self._outcome(work)

    def restore(self, lease: Lease, now_s: float) -> Outcome:
        """Take back a lease found in the state db at start-up (after :meth:`resync`).

        Through the transition table like every other change: a lease that was waiting
        is cancelled (its client's connection died with the old daemon; the wrapper
        asks again); an active one whose GPU, MIG instance or MPS host is gone is
        reclaimed; any other is bound to its instance, share or GPU again.
        """
        self.leases[lease.lease_id] = lease
        if lease.state in (LeaseState.QUEUED, LeaseState.PREPARING):
            reason = "daemon restarted while waiting"
            self._event(lease, LeaseEvent.RELEASE, now_s, reason=reason)
            return self._outcome()
        gpu = self.gpus.get(lease.gpu if lease.gpu is not None else -1)
        gone = ""
        if gpu is None or gpu.uuid != lease.gpu_uuid:
            gone = "its GPU is gone"
        elif lease.mode is GpuMode.MIG:
            inst = gpu.instance_at(lease.start) if lease.start is not None else None
            if inst is None or (lease.mig_uuid and inst.uuid != lease.mig_uuid):
                gone = "its MIG instance is gone"
            else:
                inst.lease_id, inst.idle_since_s = lease.lease_id, None
                if inst.origin is Origin.UNEXPLAINED:
                    inst.origin, inst.note = Origin.MIGD, ""
        elif lease.mode is GpuMode.MPS:
            if not self.restore_mps_share(gpu, lease):
                gone = "its MIG instance is gone"
        elif lease.mode is GpuMode.EXCLUSIVE:
            gpu.exclusive_lease = lease.lease_id
        if gone:
            self._event(lease, LeaseEvent.RECLAIM, now_s, reason=gone)
        return self._outcome()

    def quarantine(self, lease_id: str, why: str) -> str | None:
        """Keep the MIG instance of ``lease_id`` from being reused or destroyed: processes
        still run on it (call before :meth:`release`, which schedules queued requests).

        The instance is UNEXPLAINED (``migctl status`` shows ``why``) until a resync finds
        it without processes. Returns the instance's name, ``None`` if the lease has none.
        """
        lease = self.leases.get(lease_id)
        if lease is None or lease.gpu is None or lease.mode != "mig":
            return None
        inst = self.gpus[lease.gpu].instance_of(lease_id)
        if inst is None:
            return None
        inst.origin, inst.note = Origin.UNEXPLAINED, why
        return str(inst)

    def restore_mps_share(self, gpu: ManagedGpu, lease: Lease) -> bool:
        """Re-account an MPS lease found in the state db at start-up (it may overcommit).

        A share inside a MIG instance goes back to its host instance (which becomes an
        MPS host again, explained by the lease). False: that instance is gone.
        """
        request = MpsRequest(
            lease.lease_id,
            lease.owner_uid,
            lease.memory_limit_mib or 1,
            clients=lease.request.mps_clients,
            thread_percentage=lease.mps_thread_percentage,
        )
        if lease.mig_uuid is None:
            pool = self.mps_pool(gpu)
            gpu.mps_pool = replace(pool, shares=(*pool.shares, request))
            return True
        inst = gpu.instance_at(lease.start) if lease.start is not None else None
        if inst is None or inst.uuid != lease.mig_uuid or inst.lease_id is not None:
            return False
        if inst.mps_pool is None:
            inst.mps_pool = self._new_host_pool(gpu, inst.profile, inst.uuid, inst.memory_mib)
        inst.mps_pool = replace(inst.mps_pool, shares=(*inst.mps_pool.shares, request))
        inst.idle_since_s = None
        if inst.origin is Origin.UNEXPLAINED:  # its processes are the MPS server's and jobs'
            inst.origin, inst.note = Origin.MIGD, ""
        return True

    def heartbeat(self, lease_id: str, now_s: float) -> Lease:
        lease = self.leases[lease_id]
        lease.event(LeaseEvent.HEARTBEAT, now_s)  # keeps it ACTIVE: not a transition
        lease.heartbeat_s = now_s
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
                self._event(lease, LeaseEvent.EXPIRE, now_s, reason=reason)
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
        for gpu in self.gpus.values():
            if gpu.mode is not GpuMode.MIG:
                continue
            stale = [
                i
                for i in gpu.instances
                if not i.busy
                and i.idle_since_s is not None
                # a timer set for idle_since + timeout must find it due, rounding or not
                and now_s - i.idle_since_s >= self.policy.idle_timeout_s - 1e-6
            ]
            work.extend(self._teardown(gpu, stale))
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
        return self._outcome(self._teardown(gpu, leftovers))

    def reset(self, gpu_index: int) -> Outcome:
        """Destroy every idle instance of a GPU (``migctl reset``); busy ones stay."""
        gpu = self.gpus[gpu_index]
        return self._outcome(self._teardown(gpu, [i for i in gpu.instances if not i.busy]))

    def _teardown(self, gpu: ManagedGpu, instances: Sequence[ManagedInstance]) -> list[Work]:
        if not instances:
            return []
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
        out: list[dict[str, Any]] = []
        for g in gpus:
            if g.mode is GpuMode.MIG and g.space is not None:
                why = (
                    "draining"
                    if g.draining
                    else (str(g.health) if not g.health.available else "busy instances in the way")
                )
                try:
                    state = describe(g.space, g.view().key)
                except MigdError:  # a layout the state machine cannot describe (health says)
                    state = "not understood"
                out.append({"gpu": g.index, "state": state, "why": why})
            else:
                out.append({"gpu": g.index, "mode": g.mode.value, "why": "full or in use"})
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


def _partition_request(request: LeaseRequest) -> PartitionRequest:
    return PartitionRequest(
        memory_mib=request.memory_mib,
        min_compute=request.min_compute,
        profile=request.profile,
    )


def default_mps_env(gpu: ManagedGpu, lease: Lease) -> dict[str, str]:
    """The client environment of an MPS share (the daemon adds its real pipe dir): the
    granted limit, in the one format :func:`migd.core.mps.client_environment` writes."""
    return client_environment(
        lease.mig_uuid or gpu.uuid,
        lease.memory_limit_mib or lease.request.memory_mib,
        lease.mps_thread_percentage,
    )
