"""Discrete-event simulation of a node (or a small pool) driving the real scheduler.

The simulator does what the daemon does around :class:`NodeScheduler`, with
simulated time instead of NVML:

* a job arrival becomes a :class:`Lease` handed to ``submit``; on a single node
  it waits in the scheduler's own queue (scheme A/B), in a pool (or for static
  layouts) an HTCondor-like matcher in front offers it to a node that advertises
  room for it, and the node is asked with ``wait_s=0``;
* every :class:`Work` the scheduler returns is executed on its GPU's simulated
  driver: operations run one after another per GPU (the driver serialises them,
  [Villarrubia] §2.1), each taking [Villarrubia] Table 1 time (:class:`CostModel`), and
  ``work_done`` is called when the last one finishes, which is when the lease
  becomes ACTIVE and the job starts;
* a job that ends is ``release``\\ d; idle instances are torn down by
  ``idle_teardown`` when the idle timeout passes; queued requests with a
  deadline are ``expire``\\ d.

Jobs run at the speed :mod:`migd.policysim.jobs` assigns to their share of the GPU.
A job whose memory grows past its limit dies in that iteration and is
resubmitted with :func:`migd.core.restart.restart_size`, the wrapper's own rule; with
the forecast on,
:class:`migd.core.forecast.Forecaster` is fed one sample per iteration and the
job restarts as soon as it fires. The forecast's horizon is what the wrapper would
pass: the job's declared ``MigdHorizon`` (:attr:`WorkloadJob.horizon`), or none.

Nothing here decides placement, queue order or MPS admission: the scheduler
does. The matcher only ranks nodes by what they advertise (largest profile the
planner could place now, free MPS memory, a free whole GPU) and, for static
layouts, names the smallest idle instance a job fits in, as HTCondor matching a
job to a statically partitioned slot would. As in the real pool, memory a node frees
reaches the matcher ``PolicySimConfig.ad_latency_s`` late, except for the same user's next
job that fits the ended job's partition (claim reuse); docs/simulator.md, "The
matcher against the real pool".
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from migd.core.catalog import geometry
from migd.core.costs import CostModel
from migd.core.forecast import Forecaster, MemorySample
from migd.core.geometry import Geometry, Profile
from migd.core.leases import LeaseState
from migd.core.planner import (
    CreateOp,
    DestroyOp,
    Op,
    PartitionRequest,
    PlannerPolicy,
    plan_on_node,
)
from migd.core.queueing import QueuedRequest, RequestQueue
from migd.core.restart import restart_size
from migd.core.scheduler import (
    GpuMode,
    InstanceStatus,
    Lease,
    LeaseRequest,
    ManagedGpu,
    ManagedInstance,
    NodeScheduler,
    Work,
    mode_state,
)
from migd.core.scheduler import (
    Outcome as SchedOutcome,
)
from migd.core.states import StateSpace, state_space
from migd.errors import InvalidRequest, NoCapacity, RequestTooLarge
from migd.policysim.interference import CALIBRATED, MpsInterference
from migd.policysim.jobs import PowerModel, WorkloadJob, busy_fraction, demand_of, runtime_at
from migd.policysim.policies import PolicySpec

Outcome = Literal["completed", "rejected", "failed", "unfinished"]

#: Nodes a simulated pool may have (the pool-scale benchmark runs 1,000).
MAX_NODES = 4096


@dataclass(frozen=True)
class PolicySimConfig:
    """The simulated hardware and the knobs of the simulation itself.

    Attributes:
        model: catalog model of every GPU (``A100-40GB``...).
        gpus: GPUs per node (1-8).
        nodes: nodes in the pool (1: the node's own queue orders requests; more: the
            matcher does, with the policy's queue scheme).
        profiles: profile set of the MIG state machine (``classic`` as in the papers).
        power: power model; ``None`` picks :meth:`PowerModel.for_model`.
        mps_interference: extra flat slowdown of every MPS client while two or more
            share a device, on top of ``interference`` (0: the calibrated model alone).
        interference: how MPS clients share a device (a whole GPU or a MIG instance
            hosting MPS); :mod:`migd.policysim.interference`, calibrated to [Voigtlaender].
        ad_latency_s: in a pool, seconds from a node freeing GPU memory (a job's end,
            an idle teardown) until the matcher sees it in the node's ad: the real
            pool's ``migctl condor-ad --watch`` put a freed A100 in the collector
            0.8-1.9 s after the release (docs/htcondor-notes.md (r)); 1.4 s is the
            median of those runs. A node's ad that shrinks (a job placed on it) is
            seen at once, as the startd updates the collector when a slot is
            claimed. 0: every change is seen at once (the model before it was
            compared with the pool). Static layouts and single nodes ignore it.
        max_time_s: stop the simulation at this simulated time.
        check_invariants: assert capacity and layout invariants after every event
            (tests; slows the run down).
        owner_uid_default: UID of jobs that do not name one.
    """

    model: str = "A100-40GB"
    gpus: int = 1
    nodes: int = 1
    profiles: str = "classic"
    power: PowerModel | None = None
    mps_interference: float = 0.0
    interference: MpsInterference = CALIBRATED
    ad_latency_s: float = 1.4
    max_time_s: float = 365 * 86400.0
    check_invariants: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.gpus <= 8:
            raise InvalidRequest(f"gpus per node must be 1-8, got {self.gpus}")
        if not 1 <= self.nodes <= MAX_NODES:
            raise InvalidRequest(f"nodes must be 1-{MAX_NODES}, got {self.nodes}")
        if self.mps_interference < 0:
            raise InvalidRequest("mps_interference must not be negative")
        if self.ad_latency_s < 0:
            raise InvalidRequest("ad_latency_s must not be negative")


@dataclass
class Attempt:
    """One submission of a job (the first, or a restart after OOM)."""

    job: WorkloadJob
    number: int
    memory_mib: int
    min_compute: int
    submit_s: float
    wait_s: float | None

    @property
    def lease_id(self) -> str:
        return self.job.job_id if self.number == 0 else f"{self.job.job_id}#{self.number}"


@dataclass
class JobRecord:
    """What happened to one job, over all its attempts."""

    job: WorkloadJob
    attempts: int = 0
    first_start_s: float | None = None
    end_s: float | None = None
    outcome: Outcome = "unfinished"
    reason: str = ""
    oom_kills: int = 0
    forecast_kills: int = 0
    lost_gpu_s: float = 0.0  # GPU-seconds (share x time) of runs killed by OOM or forecast
    lost_wall_s: float = 0.0
    profiles: list[str] = field(default_factory=list)  # what each attempt ran on
    hybrid: list[str] = field(default_factory=list)  # the hybrid's reason per attempt

    @property
    def turnaround_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.job.submit_s


@dataclass
class _Run:
    attempt: Attempt
    node: int
    gpu: int
    mode: str
    share: float
    rate: float
    progress: float
    last_s: float
    start_s: float
    stop_progress: float
    stop: Literal["done", "oom", "forecast"]
    needed_mib: int
    limit_mib: int
    busy: float = 0.0
    alloc_slices: float = 0.0
    gpu_s: float = 0.0
    version: int = 0
    label: str = ""
    profile: str | None = None
    unit_start: int = 0
    units: int = 0
    host: int = -1  # MPS: start of the MIG instance hosting the server, -1 whole GPU
    host_slices: int = 0  # and its compute slices
    uid: int = 0

    def span(self, lease_id: str, end_s: float, how: str) -> Span:
        """This run on the slice map, from its start to ``end_s``, ended ``how``."""
        return Span(
            self.node,
            self.gpu,
            self.label,
            self.unit_start,
            self.units,
            self.start_s,
            end_s,
            "job",
            how,
            lease_id,
            self.profile or self.mode,
        )


@dataclass(frozen=True)
class Span:
    """An interval on one GPU for the slice map: an instance or a job run.

    ``what`` is the profile name of an instance, the job kind of a run. ``label`` is
    how it ended: ``destroyed`` or ``open`` (instances), ``done``, ``oom``,
    ``forecast`` or ``unfinished`` (runs). Runs also name their ``job`` (lease id)
    and ``partition`` (profile name, ``mps`` or ``exclusive``).
    """

    node: int
    gpu: int
    what: str
    unit_start: int
    units: int
    start_s: float
    end_s: float
    kind: Literal["instance", "job"]
    label: str = ""
    job: str = ""
    partition: str = ""


@dataclass
class ReconfigStats:
    creates: int = 0
    destroys: int = 0
    create_s: float = 0.0
    destroy_s: float = 0.0
    works: int = 0


@dataclass
class PolicySimResult:
    """Raw output of one run; :mod:`migd.policysim.metrics` turns it into numbers."""

    policy: PolicySpec
    config: PolicySimConfig
    geometry: Geometry
    records: list[JobRecord]
    end_s: float
    timelines: dict[tuple[int, int], list[tuple[float, float, float, float, float]]]
    spans: list[Span]
    reconfig: ReconfigStats
    power: PowerModel
    events: int
    max_queue: int
    notes: list[str] = field(default_factory=list)
    isolation_breaches: int = 0  # runs that shared an MPS server with another user's job


def index_order(geo: Geometry) -> Geometry:
    """``geo`` with every profile's default placement order sorted by start.

    [Siavashi]'s first-fit baseline assigns instances "sequentially" (the lowest free
    start first) instead of the driver's observed order (A100 1g: 6, 4, 5, 0, ...).
    """
    profiles = tuple(replace(p, default_order=tuple(sorted(p.default_order))) for p in geo.profiles)
    # the lookup tables are rebuilt from the new profiles, never shared with ``geo``
    return replace(geo, profiles=profiles)


class _Node:
    def __init__(self, index: int, scheduler: NodeScheduler) -> None:
        self.index = index
        self.scheduler = scheduler
        self.driver_free: dict[int, float] = dict.fromkeys(scheduler.gpus, 0.0)
        self.pending: dict[str, Attempt] = {}
        self.capacity: int | None = None  # advertised MiB, cached until the node changes
        self.ad_due: float | None = None  # when its pending, freed-memory ad is seen
        self.rooms: dict[int | None, int] = {}  # its MPS hosts' unpinned MiB by user


class Simulation:
    """One policy on one workload. Call :meth:`run` once.

    Args:
        jobs: the workload (any order; arrivals are sorted by ``submit_s``, ties keep
            the list order).
        policy: the scheduler configuration under test.
        config: hardware and simulation knobs.
        progress: called now and then with (simulated now, jobs ended, jobs total).
    """

    def __init__(
        self,
        jobs: Sequence[WorkloadJob],
        policy: PolicySpec,
        config: PolicySimConfig | None = None,
        *,
        progress: Callable[[float, int, int], None] | None = None,
    ) -> None:
        self.config = config or PolicySimConfig()
        self.policy = policy
        self.geo = geometry(self.config.model)
        if policy.start_order == "index":
            self.geo = index_order(self.geo)
        self.space: StateSpace = state_space(self.geo, self.config.profiles)
        self.costs = CostModel.for_model(self.geo.model)
        self.power = self.config.power or PowerModel.for_model(
            self.geo.model, self.geo.compute_slices
        )
        self.compute = self.geo.compute_slices
        self.progress = progress
        ids = [j.job_id for j in jobs]
        if len(set(ids)) != len(ids):
            raise InvalidRequest("job ids must be unique")
        self.jobs = sorted(jobs, key=lambda j: j.submit_s)
        self.records: dict[str, JobRecord] = {j.job_id: JobRecord(j) for j in self.jobs}
        self.now = 0.0
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self.runs: dict[str, _Run] = {}
        # the same runs by (node, GPU): sampling and MPS sharing look at one GPU only
        self._gpu_runs: dict[tuple[int, int], dict[str, _Run]] = {}
        self._advert_cache: dict[Hashable, int] = {}
        self._by_capacity: dict[int, set[int]] = {}  # advertised MiB -> node indices
        self._stale: set[int] = set()  # nodes whose advertised MiB must be computed again
        self._rooms: dict[int | None, dict[int, int]] = {}  # uid -> node -> MPS host MiB
        self._gi = itertools.count(1)
        self.timelines: dict[tuple[int, int], list[tuple[float, float, float, float, float]]] = {}
        self.spans: list[Span] = []
        self._open_instances: dict[tuple[int, int, int], tuple[str, int, float]] = {}
        self.reconfig = ReconfigStats()
        self._stop_cache: dict[tuple[str, int, bool], tuple[int | None, str, int]] = {}
        self._events = 0
        self._ended = 0
        self._max_queue = 0
        self.isolation_breaches = 0
        self.notes: list[str] = []
        self._dirty: set[int] = set()
        self._negotiate = False
        self.nodes = [self._build_node(i) for i in range(self.config.nodes)]
        self._stale.update(range(len(self.nodes)))
        self.matcher: RequestQueue[Attempt] | None = None
        if self.config.nodes > 1 or policy.static_layout is not None:
            sched = policy.scheduler
            # The policy's own queue scheme, static layouts included, so "(B)" is FIFO
            # for every policy. (HTCondor's negotiator skips jobs that match no slot,
            # i.e. backfills: scheme A is the closer model of a static pool.)
            self.matcher = RequestQueue(
                policy=sched.queue,
                aging_s=sched.aging_s,
                starvation_s=sched.starvation_s,
                backfill=sched.backfill,
            )
        for key in ((n.index, g) for n in self.nodes for g in n.scheduler.gpus):
            self.timelines[key] = [(0.0, 0.0, 0.0, 0.0, 0.0)]
            self._sample(*key)

    # -- set-up ------------------------------------------------------------------------------

    def _build_node(self, index: int) -> _Node:
        gpus = []
        mode = self.policy.gpu_mode
        for g in range(self.config.gpus):
            gpu = ManagedGpu(
                index=g,
                uuid=f"GPU-sim-{index:02d}-{g}",
                model=self.geo.model,
                name=self.geo.display_name,
                memory_total_mib=self.geo.memory_mib,
                state=mode_state(
                    mode,
                    self.space if mode is GpuMode.MIG else None,
                    mps_in_mig=self.policy.mps_in_mig and mode is GpuMode.MIG,
                ),
            )
            if self.policy.static_layout is not None:
                mig = gpu.mig
                if mig is None:
                    raise InvalidRequest("a static layout needs GpuMode.MIG")
                for name, start in self.policy.static_layout:
                    prof = self.space.member(name)
                    n = next(self._gi)
                    mig.instances.append(
                        ManagedInstance(
                            profile=prof,
                            start=start,
                            memory_mib=prof.memory_mib,
                            gi_id=n,
                            uuid=f"MIG-sim-{index}-{g}-{n}",
                            idle_since_s=0.0,
                        )
                    )
                    self._open_instances[(index, g, start)] = (prof.name, prof.memory_slices, 0.0)
                self.space.key_of((i.profile, i.start) for i in gpu.instances)  # validate
            gpus.append(gpu)
        return _Node(index, NodeScheduler(gpus, self.policy.scheduler))

    # -- event queue -------------------------------------------------------------------------

    def _push(self, when: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), kind, payload))

    def run(self) -> PolicySimResult:
        """Run to completion (or ``max_time_s``) and return the raw result."""
        for job in self.jobs:
            attempt = Attempt(job, 0, job.memory_mib, job.min_compute, job.submit_s, job.wait_s)
            self._push(job.submit_s, "arrive", attempt)
        total = len(self.jobs)
        last_report = 0
        while self._heap:
            when, _, kind, payload = heapq.heappop(self._heap)
            if when > self.config.max_time_s:
                self.notes.append(f"stopped at max_time_s={self.config.max_time_s:g}")
                break
            self.now = max(self.now, when)
            self._events += 1
            getattr(self, f"_on_{kind}")(payload)
            self._settle()
            if self.config.check_invariants:
                self.check_invariants()
            if self.progress is not None and self._ended - last_report >= max(1, total // 50):
                last_report = self._ended
                self.progress(self.now, self._ended, total)
        for run in list(self.runs.values()):
            self._advance(run)
        return self._result()

    def _settle(self) -> None:
        """Start jobs whose leases became active; negotiate until nothing changes."""
        for _ in range(1000):
            while self._dirty:
                node = self.nodes[self._dirty.pop()]
                self._activate(node)
                # the daemon drops ended leases once persisted and answered
                node.scheduler.forget_terminal()
            if not (self._negotiate and self.matcher is not None and len(self.matcher)):
                self._negotiate = False
                return
            self._negotiate = False
            self.matcher.schedule(self.now, self._try_place_item)
            self._max_queue = max(self._max_queue, len(self.matcher))
        raise AssertionError("matcher did not settle")  # pragma: no cover

    # -- arrivals and placement ----------------------------------------------------------------

    def _on_arrive(self, attempt: Attempt) -> None:
        record = self.records[attempt.job.job_id]
        record.attempts += 1
        if self.matcher is None:
            self._submit_direct(attempt)
            return
        if not any(self._ever_fits(node, attempt) for node in self.nodes):
            self._refuse(attempt, "no partition on any node can ever hold it")
            return
        if attempt.wait_s is not None and attempt.wait_s <= 0:
            if not self._try_place(attempt):
                self._refuse(attempt, "no room at submission (wait_s=0)")
            return
        self.matcher.push(
            attempt.lease_id,
            attempt,
            now_s=self.now,
            memory_mib=attempt.memory_mib,
            wait_s=attempt.wait_s,
        )
        self._max_queue = max(self._max_queue, len(self.matcher))
        if attempt.wait_s is not None:
            self._push(self.now + attempt.wait_s, "deadline", None)
        self._negotiate = True

    def _lease(self, attempt: Attempt, wait_s: float | None, profile: str | None = None) -> Lease:
        request = LeaseRequest(
            job_id=attempt.lease_id,
            memory_mib=attempt.memory_mib,
            min_compute=attempt.min_compute,
            profile=profile,
            wait_s=wait_s,
        )
        return Lease(attempt.lease_id, request, attempt.job.uid, 1, self.now)

    def _submit_direct(self, attempt: Attempt) -> None:
        node = self.nodes[0]
        lease = self._lease(attempt, attempt.wait_s)
        try:
            outcome = node.scheduler.submit(lease, self.now, self.now)
        except RequestTooLarge as exc:
            self._refuse(attempt, exc.message)
            return
        self._apply(node, outcome)
        if outcome.refusal is not None:
            self._refuse(attempt, outcome.refusal.message)
            return
        node.pending[attempt.lease_id] = attempt
        self._max_queue = max(self._max_queue, len(node.scheduler.queue))
        if attempt.wait_s is not None and attempt.wait_s > 0:
            self._push(self.now + attempt.wait_s, "deadline", None)

    def _ever_fits(self, node: _Node, attempt: Attempt) -> bool:
        """What the node's machine ad says about the job, ignoring what is in use now.

        The node's own check (:meth:`NodeScheduler.check_ever_fits`, as ``submit``
        does it); a static node advertises only its instances, as HTCondor slots.
        """
        try:
            node.scheduler.check_ever_fits(self._lease(attempt, None))
        except (RequestTooLarge, InvalidRequest):
            return False
        if self.policy.static_layout is None:
            return True
        gpus = node.scheduler.gpus.values()
        return any(self._holds(i.profile, attempt) for g in gpus for i in g.instances)

    @staticmethod
    def _holds(profile: Profile, attempt: Attempt) -> bool:
        return (
            profile.memory_mib >= attempt.memory_mib
            and profile.compute_slices >= attempt.min_compute
        )

    def _reuse_claim(self, node: _Node, run: _Run) -> None:
        """The schedd keeps the claim on the dynamic slot a finished job leaves and
        starts the user's next idle job that fits the slot's ``VRAM`` there at once,
        before any ad shows the freed memory (``MIGD_START``'s dynamic-slot clause;
        whole-GPU wave in the real pool: the next lease 0.2-0.8 s after the end,
        docs/htcondor-notes.md (r)). Only where ads lag: with ``ad_latency_s = 0`` the
        matcher sees the freed memory at once anyway."""
        if self.matcher is None or self.policy.static_layout is not None:
            return
        if self.config.ad_latency_s <= 0:
            return
        uid = run.attempt.job.uid
        for item in self.matcher.order(self.now):
            attempt = item.payload
            if attempt.job.uid != uid or attempt.memory_mib > run.limit_mib:
                continue
            if self._submit_now(node, attempt, None):
                self.matcher.remove(item.ident)
            return  # one slot, one job

    def _on_advertise(self, node_index: int) -> None:
        """A node's freed memory reaches the matcher (``ad_latency_s`` after it freed it)."""
        node = self.nodes[node_index]
        if node.ad_due is not None and node.ad_due <= self.now:
            self._invalidate(node)
            self._negotiate = True

    def _invalidate(self, node: _Node) -> None:
        """The node changed: its advertised capacity is computed again when asked."""
        node.ad_due = None  # a fresh ad carries every change so far
        if node.capacity is not None:
            self._by_capacity[node.capacity].discard(node.index)
            node.capacity = None
        for uid in node.rooms:
            self._rooms[uid].pop(node.index, None)
        node.rooms = {}
        self._stale.add(node.index)

    def _fitting_nodes(self, memory_mib: int, uid: int) -> list[_Node]:
        """Nodes that advertise at least ``memory_mib`` to user ``uid``, in the policy's
        node order.

        Nodes are kept in buckets by advertised MiB (a few distinct values), so a pool
        of a thousand nodes costs one look per bucket, not one per node and job. MPS
        servers inside MIG instances serve one user each (unless multi-user): their
        unpinned MiB is advertised to that user only (``_rooms``).
        """
        for index in self._stale:
            node = self.nodes[index]
            self._by_capacity.setdefault(self._advertised_mib(node), set()).add(index)
            node.rooms = self._host_rooms(node)
            for who, room in node.rooms.items():
                self._rooms.setdefault(who, {})[index] = room
        self._stale.clear()
        cap: dict[int, int] = {
            i: c for c, ids in self._by_capacity.items() if c >= memory_mib for i in ids
        }
        for who in (uid, None):
            for i, room in self._rooms.get(who, {}).items():
                if room >= memory_mib and room > cap.get(i, -1):
                    cap[i] = room
        if self.policy.node_order == "best-fit":
            return [self.nodes[i] for i in sorted(cap, key=lambda i: (cap[i], i))]
        return [self.nodes[i] for i in sorted(cap)]

    @staticmethod
    def _host_rooms(node: _Node) -> dict[int | None, int]:
        """Unpinned MiB of the node's MPS hosts by the user they serve (None: anyone)."""
        rooms: dict[int | None, int] = {}
        for gpu in node.scheduler.gpus.values():
            for inst in gpu.instances:
                pool = inst.mps_pool
                if pool is None or inst.status is not InstanceStatus.READY:
                    continue
                if pool.clients >= pool.max_clients:
                    continue
                users = {share.uid for share in pool.shares}
                who = (
                    users.pop()
                    if len(users) == 1 and not node.scheduler.policy.mps_multi_user
                    else None
                )
                rooms[who] = max(rooms.get(who, 0), pool.free_mib)
        return rooms

    def _advertised_mib(self, node: _Node) -> int:
        """The most memory one new job could get on the node now (its machine ad)."""
        if node.capacity is not None:
            return node.capacity
        sched = node.scheduler
        best = 0
        for gpu in sched.gpus.values():
            if gpu.mode is GpuMode.MIG and gpu.space is not None:
                # memoised per layout (the sim asks after every event), unlike mode_ops
                best = max(best, self._mig_advert(gpu, sched.policy.planner))
            elif gpu.available and (found := sched.mode_ops(gpu).largest_placeable(gpu)):
                best = max(best, found[1])
        node.capacity = best
        return best

    def _mig_advert(self, gpu: ManagedGpu, planner: PlannerPolicy) -> int:
        """The largest profile the planner could place on ``gpu`` now (MiB).

        Placeable on a node means placeable on one of its GPUs, and the answer depends
        only on the GPU's layout and which instances are busy: memoised by that, so a
        pool of thousands of GPUs with a few hundred distinct layouts plans each once.
        """
        view = gpu.view()
        key = (view.available, tuple((i.profile.name, i.start, i.busy) for i in view.instances))
        hit = self._advert_cache.get(key)
        if hit is not None:
            return hit
        best = 0
        for prof in sorted(self.space.profiles, key=lambda p: -p.memory_mib):
            if prof.memory_mib <= best:
                break
            try:
                plan_on_node(
                    [view], PartitionRequest(prof.memory_mib, prof.compute_slices), planner
                )
            except (NoCapacity, RequestTooLarge):
                continue
            best = prof.memory_mib
        self._advert_cache[key] = best
        return best

    def _try_place_item(self, item: QueuedRequest[Attempt]) -> bool:
        return self._try_place(item.payload)

    def _try_place(self, attempt: Attempt) -> bool:
        if self.policy.static_layout is not None:
            return self._try_place_static(attempt)
        fits = self._fitting_nodes(attempt.memory_mib, attempt.job.uid)
        return any(self._submit_now(node, attempt, None) for node in fits)

    def _try_place_static(self, attempt: Attempt) -> bool:
        idle: list[tuple[int, int, int, int, Profile]] = []
        for node in self.nodes:
            for gpu in node.scheduler.gpus.values():
                for inst in gpu.instances:
                    if not inst.busy and self._holds(inst.profile, attempt):
                        p = inst.profile
                        idle.append((p.memory_mib, p.compute_slices, node.index, gpu.index, p))
        for *_, node_index, _gpu, prof in sorted(idle, key=lambda x: x[:4]):
            if self._submit_now(self.nodes[node_index], attempt, prof.name):
                return True
        return False

    def _submit_now(self, node: _Node, attempt: Attempt, profile: str | None) -> bool:
        lease = self._lease(attempt, 0.0, profile)
        try:
            outcome = node.scheduler.submit(lease, self.now, self.now)
        except (RequestTooLarge, InvalidRequest):
            return False
        self._apply(node, outcome, placed=True)
        if outcome.refusal is not None:
            return False
        node.pending[attempt.lease_id] = attempt
        return True

    def _refuse(self, attempt: Attempt, why: str) -> None:
        record = self.records[attempt.job.job_id]
        if attempt.number == 0:
            record.outcome, record.reason = "rejected", why
        else:
            record.outcome, record.reason = "failed", f"restart refused: {why}"
        record.end_s = None
        self._ended += 1

    def _on_deadline(self, _: None) -> None:
        for node in self.nodes:
            expired = node.scheduler.expire(self.now, self.now)
            for lease in expired.ended:
                attempt = node.pending.pop(lease.lease_id, None)
                if attempt is not None:
                    self._refuse(attempt, "no partition before its deadline")
            self._apply(node, expired)
        if self.matcher is not None:
            for item in self.matcher.expired(self.now):
                self._refuse(item.payload, "no partition before its deadline")

    # -- NVML work ---------------------------------------------------------------------------

    def _op_cost(self, op: Op) -> float:
        if isinstance(op, CreateOp):
            return self.costs.create_s(op.profile.compute_slices)
        return self.costs.destroy_s(op.profile.compute_slices)

    def _apply(self, node: _Node, outcome: SchedOutcome, *, placed: bool = False) -> None:
        """Act on a scheduler outcome as the daemon does: run its work (in simulated
        time), and look at the node's leases again (grants start jobs). A node whose
        books changed advertises anew to the matcher: at once when a job was
        ``placed`` on it (its ad shrinks), else after ``ad_latency_s`` (what it frees
        reaches the collector that much later)."""
        if outcome.work or outcome.transitions:
            if placed or self.matcher is None or self.config.ad_latency_s <= 0:
                self._invalidate(node)
            elif node.ad_due is None:
                node.ad_due = self.now + self.config.ad_latency_s
                self._push(node.ad_due, "advertise", node.index)
        self._execute(node, outcome.work)
        self._dirty.add(node.index)

    def _execute(self, node: _Node, works: Sequence[Work]) -> None:
        for work in works:
            if not work.ops:
                continue
            start = max(self.now, node.driver_free[work.gpu])
            t = start
            timed: list[tuple[Op, float]] = []
            for op in work.ops:
                cost = self._op_cost(op)
                t += cost
                timed.append((op, t))
                if isinstance(op, CreateOp):
                    self.reconfig.creates += 1
                    self.reconfig.create_s += cost
                else:
                    self.reconfig.destroys += 1
                    self.reconfig.destroy_s += cost
            self.reconfig.works += 1
            node.driver_free[work.gpu] = t
            self._push(t, "work", (node.index, work, tuple(timed)))
            self._sample(node.index, work.gpu)

    def _on_work(self, payload: tuple[int, Work, tuple[tuple[Op, float], ...]]) -> None:
        node_index, work, timed = payload
        node = self.nodes[node_index]
        created: dict[int, tuple[int | None, str | None, int]] = {}
        for op, at in timed:
            key = (node_index, work.gpu, op.start)
            if isinstance(op, DestroyOp):
                opened = self._open_instances.pop(key, None)
                if opened is not None:
                    name, units, since = opened
                    self.spans.append(
                        Span(
                            node_index,
                            work.gpu,
                            name,
                            op.start,
                            units,
                            since,
                            at,
                            "instance",
                            "destroyed",
                        )
                    )
            else:
                n = next(self._gi)
                created[op.start] = (
                    n,
                    f"MIG-sim-{node_index}-{work.gpu}-{n}",
                    op.profile.memory_mib,
                )
                self._open_instances[key] = (op.profile.name, op.profile.memory_slices, at)
        self._apply(node, node.scheduler.work_done(work, created, self.now, self.now))
        self._sample(node_index, work.gpu)

    # -- running jobs --------------------------------------------------------------------------

    def _activate(self, node: _Node) -> None:
        for lease_id, attempt in list(node.pending.items()):
            lease = node.scheduler.leases.get(lease_id)
            # ended leases are forgotten only after this pass has seen them
            assert lease is not None, f"{lease_id}: lease vanished before it was seen"
            if lease.state is LeaseState.ACTIVE:
                del node.pending[lease_id]
                self._start(node, attempt, lease)
            elif lease.state.terminal:
                del node.pending[lease_id]
                self._refuse(attempt, lease.reason or lease.state.value)

    def _start(self, node: _Node, attempt: Attempt, lease: Lease) -> None:
        assert lease.gpu is not None and lease.mode is not None
        gpu = node.scheduler.gpus[lease.gpu]
        job = attempt.job
        record = self.records[job.job_id]
        if record.first_start_s is None:
            record.first_start_s = self.now
        share = 1.0
        alloc = float(self.compute)
        unit_start, units = 0, self.geo.units
        label = str(lease.mode)  # a plain str, like the profile names below
        host = -1  # the MIG instance an MPS share runs in (start), -1: the whole GPU
        if lease.mode == "mig" or (lease.mode == "mps" and lease.profile is not None):
            assert gpu.space is not None and lease.profile is not None and lease.start is not None
            prof = gpu.space.member(lease.profile)
            share = prof.compute_slices / self.compute
            alloc = float(prof.compute_slices)
            unit_start, units, label = lease.start, prof.memory_slices, prof.name
            if lease.mode == "mps":
                host, label = lease.start, f"mps@{prof.name}"
        limit = lease.memory_limit_mib or attempt.memory_mib
        record.profiles.append(label)
        if lease.decision is not None and "hybrid" in lease.decision:
            record.hybrid.append(str(lease.decision["hybrid"]))
        stop_iter, stop, needed = self._stop_point(job, limit)
        stop_progress = 1.0
        if stop_iter is not None and job.growth is not None:
            stop_progress = (stop_iter + 1) / job.growth.iterations
        run = _Run(
            attempt=attempt,
            node=node.index,
            gpu=gpu.index,
            mode=lease.mode,
            share=share,
            rate=1.0 / runtime_at(job, share, self.compute),
            progress=0.0,
            last_s=self.now,
            start_s=self.now,
            stop_progress=stop_progress,
            stop=stop,  # type: ignore[arg-type]
            needed_mib=needed,
            limit_mib=limit,
            busy=busy_fraction(job, share, self.compute),
            alloc_slices=alloc,
            label=job.kind or job.job_id,
            unit_start=unit_start,
            units=units,
            profile=lease.profile if lease.mode == "mig" else None,
            host=host,
            host_slices=int(alloc) if host >= 0 else 0,
            uid=job.uid,
        )
        self.runs[lease.lease_id] = run
        self._gpu_runs.setdefault((run.node, run.gpu), {})[lease.lease_id] = run
        if lease.mode == "mps":
            self._count_breaches(lease.lease_id, run)
            self._rebalance_mps(node.index, gpu.index, host)
        else:
            self._schedule_end(lease.lease_id, run)
        self._sample(node.index, gpu.index)

    def _stop_point(self, job: WorkloadJob, limit_mib: int) -> tuple[int | None, str, int]:
        """Where a run with ``limit_mib`` ends early: (iteration, why, MiB the forecast wants)."""
        growth = job.growth
        if growth is None:
            return None, "done", 0
        key = (job.job_id, limit_mib, self.policy.forecast)
        cached = self._stop_cache.get(key)
        if cached is not None:
            return cached
        oom = growth.first_over(limit_mib)
        result: tuple[int | None, str, int] = (
            (oom, "oom", 0) if oom is not None else (None, "done", 0)
        )
        if self.policy.forecast:
            forecaster = Forecaster(self.policy.forecast_policy)
            # what the wrapper passes: the job's declared MigdHorizon, or none (then the
            # forecaster looks as far ahead as it has observed)
            horizon = job.horizon
            until = oom if oom is not None else growth.iterations
            for i in range(until):
                forecaster.observe(MemorySample(i, used_mib=growth.series[i]))
                verdict = forecaster.verdict(limit_mib, horizon=horizon)
                if verdict.fire:
                    needed = verdict.needed_mib
                    if self.policy.forecast_sizing == "point":
                        needed = self.policy.forecast_policy.needed_mib(verdict.predicted_peak_mib)
                    result = (i, "forecast", needed)
                    break
        self._stop_cache[key] = result
        return result

    def _advance(self, run: _Run) -> None:
        dt = self.now - run.last_s
        if dt > 0:
            run.progress += dt * run.rate
            run.gpu_s += dt * run.share
            run.last_s = self.now

    def _schedule_end(self, lease_id: str, run: _Run) -> None:
        run.version += 1
        remaining = max(0.0, run.stop_progress - run.progress)
        self._push(self.now + remaining / run.rate, "end", (lease_id, run.version))

    def _rebalance_mps(self, node_index: int, gpu_index: int, host: int) -> None:
        """Share one MPS device among its clients (:mod:`migd.policysim.interference`).

        The device is the whole GPU (``host == -1``) or the MIG instance at ``host``;
        an instance offers its compute slices' share of the GPU.
        """
        members = [
            (lid, r)
            for lid, r in self._gpu_runs.get((node_index, gpu_index), {}).items()
            if r.mode == "mps" and r.host == host
        ]
        if not members:
            return
        capacity = 1.0
        if host >= 0:
            capacity = members[0][1].host_slices / self.compute
        demands = [demand_of(r.attempt.job, self.compute) for _, r in members]
        model = self.config.interference
        if self.config.mps_interference:
            model = replace(model, flat=model.flat + self.config.mps_interference)
        shares = model.shares(demands, capacity)
        for (lid, run), share in zip(members, shares, strict=True):
            if share == run.share and run.version > 0:
                continue  # its speed did not change: its end event stands
            self._advance(run)
            run.share = share
            run.rate = 1.0 / runtime_at(run.attempt.job, run.share, self.compute)
            run.busy = run.share
            run.alloc_slices = run.share * self.compute
            self._schedule_end(lid, run)

    def _count_breaches(self, lease_id: str, run: _Run) -> None:
        """Memory isolation: a job that shares an MPS server with another user's job."""
        for lid, other in self._gpu_runs.get((run.node, run.gpu), {}).items():
            if (
                lid != lease_id
                and other.mode == "mps"
                and other.host == run.host
                and other.uid != run.uid
            ):
                self.isolation_breaches += 1
                return

    def _on_end(self, payload: tuple[str, int]) -> None:
        lease_id, version = payload
        run = self.runs.get(lease_id)
        if run is None or run.version != version:
            return  # superseded by an MPS rebalance
        self._advance(run)
        del self.runs[lease_id]
        del self._gpu_runs[(run.node, run.gpu)][lease_id]
        attempt = run.attempt
        job = attempt.job
        record = self.records[job.job_id]
        self.spans.append(run.span(lease_id, self.now, run.stop))
        node = self.nodes[run.node]
        self._apply(node, node.scheduler.release(lease_id, self.now, self.now, reason=run.stop))
        self._negotiate = True
        if run.stop == "done":
            self._reuse_claim(node, run)
        if run.mode == "mps":
            self._rebalance_mps(run.node, run.gpu, run.host)
        sched_policy = node.scheduler.policy
        if (run.mode == "mig" or run.host >= 0) and sched_policy.idle_policy == "timeout":
            self._push(self.now + sched_policy.idle_timeout_s, "idle", node.index)
        self._sample(run.node, run.gpu)
        if run.stop == "done":
            record.outcome, record.end_s = "completed", self.now
            self._ended += 1
            return
        record.lost_gpu_s += run.gpu_s
        record.lost_wall_s += self.now - run.start_s
        if run.stop == "oom":
            record.oom_kills += 1
        else:
            record.forecast_kills += 1
        bigger = self._next_size(run, node)
        if bigger is None:
            record.outcome = "failed"
            record.reason = f"out of memory on the largest partition ({run.limit_mib} MiB)"
            self._ended += 1
            return
        retry = replace(
            attempt,
            number=attempt.number + 1,
            memory_mib=bigger,
            submit_s=self.now,
            wait_s=None,  # the job was accepted once; its restart waits
        )
        self._push(self.now, "arrive", retry)

    def _next_size(self, run: _Run, node: _Node) -> int | None:
        """Memory to ask for on restart, by the wrapper's rule; ``None``: nothing bigger."""
        needed = run.needed_mib if run.stop == "forecast" else None
        if run.mode == "mig":
            sizes = [p.memory_mib for p in self.space.profiles]
            largest = max(sizes)
        elif run.mode == "exclusive":
            sizes, largest = [], run.limit_mib  # it had the whole GPU
        else:
            sizes, largest = [], self.geo.memory_mib - node.scheduler.policy.mps_reserve_mib
        size = restart_size(
            run.limit_mib,
            ladder=run.mode == "mig",
            largest_mib=largest,
            needed_mib=needed,
            sizes=sizes,
        )
        return size.request_mib

    def _on_idle(self, node_index: int) -> None:
        node = self.nodes[node_index]
        outcome = node.scheduler.idle_teardown(self.now, self.now)
        if outcome.work:  # (its work places what the torn-down slices make room for)
            self._apply(node, outcome)
            self._negotiate = True

    # -- bookkeeping -----------------------------------------------------------------------------

    def _sample(self, node_index: int, gpu_index: int) -> None:
        """Record the GPU's busy, allocated, held and wasted slices from now on."""
        runs = self._gpu_runs.get((node_index, gpu_index), {}).values()
        busy = sum(r.busy for r in runs) * self.compute
        alloc = min(float(self.compute), sum(r.alloc_slices for r in runs))
        gpu = self.nodes[node_index].scheduler.gpus[gpu_index]
        held = wasted = 0.0
        if gpu.mode is GpuMode.MIG and gpu.space is not None:
            held = float(sum(i.profile.compute_slices for i in gpu.instances))
            key = gpu.view().key
            compute_w, unit_w = gpu.space.wasted_slices(key)
            wasted = float(compute_w + unit_w)
        row = (self.now, busy, alloc, held, wasted)
        line = self.timelines[(node_index, gpu_index)]
        if line[-1][1:] == row[1:]:
            return
        if line[-1][0] == self.now:
            line[-1] = row
        else:
            line.append(row)

    def check_invariants(self) -> None:
        """Assert what must hold after every event (used by the tests).

        Raises:
            AssertionError: a GPU holds more than it has, a layout is not a valid state,
                a running job has no instance, an exclusive GPU runs two jobs, or a node
                keeps an ended lease (the daemon drops them).
        """
        for node in self.nodes:
            ended = [k for k, v in node.scheduler.leases.items() if v.state.terminal]
            assert not ended, f"node {node.index} keeps ended leases {ended}"
            for gpu in node.scheduler.gpus.values():
                runs = [
                    (lid, r)
                    for lid, r in self.runs.items()
                    if r.node == node.index and r.gpu == gpu.index
                ]
                if gpu.mode is GpuMode.MIG:
                    assert gpu.space is not None
                    gpu.space.key_of(
                        (i.profile, i.start)
                        for i in gpu.instances
                        if i.status is not InstanceStatus.DESTROYING
                    )
                    used = 0
                    taken = 0
                    hosts: dict[int, list[_Run]] = {}
                    for lid, r in runs:
                        inst = gpu.instance_at(r.unit_start)
                        if r.mode == "mps":  # a share of the MPS server inside an instance
                            assert inst is not None and inst.mps_pool is not None, f"{lid}: host"
                            assert inst.mps_pool.share(lid) is not None, f"{lid}: no share"
                            assert inst.status is InstanceStatus.READY, f"{lid}: host not ready"
                            hosts.setdefault(r.host, []).append(r)
                            continue
                        assert inst is not None and inst.lease_id == lid, f"{lid}: no instance"
                        assert inst.status is InstanceStatus.READY, f"{lid}: instance not ready"
                        used += inst.profile.compute_slices
                        mask = inst.profile.units_mask(inst.start)
                        assert not taken & mask, f"{lid}: overlapping units"
                        taken |= mask
                    for start, members in hosts.items():
                        inst = gpu.instance_at(start)
                        assert inst is not None and inst.mps_pool is not None
                        pinned = sum(r.attempt.memory_mib for r in members)
                        assert pinned <= inst.mps_pool.capacity_mib, f"host {inst}: {pinned} MiB"
                        assert len({r.uid for r in members}) == 1 or (
                            node.scheduler.policy.mps_multi_user
                        ), f"host {inst}: clients of several users"
                        mask = inst.profile.units_mask(inst.start)
                        assert not taken & mask, f"host {inst}: overlapping units"
                        taken |= mask
                        used += inst.profile.compute_slices
                    assert used <= self.compute, f"GPU {gpu.index}: {used} compute slices busy"
                elif gpu.mode is GpuMode.EXCLUSIVE:
                    assert len(runs) <= 1, f"GPU {gpu.index}: {len(runs)} jobs on an exclusive GPU"
                elif gpu.mode is GpuMode.MPS:
                    pinned = sum(r.attempt.memory_mib for _, r in runs)
                    cap = gpu.memory_total_mib - node.scheduler.policy.mps_reserve_mib
                    assert pinned <= cap, f"GPU {gpu.index}: {pinned} MiB pinned of {cap}"
                    assert sum(r.share for _, r in runs) <= 1.0 + 1e-9

    def _result(self) -> PolicySimResult:
        for (node_index, gpu_index, start), (name, units, since) in self._open_instances.items():
            self.spans.append(
                Span(node_index, gpu_index, name, start, units, since, self.now, "instance", "open")
            )
        self._open_instances.clear()
        for lease_id, run in self.runs.items():
            self.spans.append(run.span(lease_id, self.now, "unfinished"))
        return PolicySimResult(
            policy=self.policy,
            config=self.config,
            geometry=self.geo,
            records=list(self.records.values()),
            end_s=self.now,
            timelines=self.timelines,
            spans=self.spans,
            reconfig=self.reconfig,
            power=self.power,
            events=self._events,
            max_queue=self._max_queue,
            notes=self.notes,
            isolation_breaches=self.isolation_breaches,
        )


def simulate(
    jobs: Sequence[WorkloadJob],
    policy: PolicySpec,
    config: PolicySimConfig | None = None,
    *,
    progress: Callable[[float, int, int], None] | None = None,
) -> PolicySimResult:
    """Run one policy on one workload (see :class:`Simulation`)."""
    return Simulation(jobs, policy, config, progress=progress).run()


__all__ = [
    "Attempt",
    "JobRecord",
    "PolicySimConfig",
    "PolicySimResult",
    "ReconfigStats",
    "Simulation",
    "Span",
    "simulate",
]
