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

The modules, one way (each imports only those above it):

* :mod:`migd.policysim.records` - configuration, attempts, job records, spans, the result;
* :mod:`migd.policysim.driver` - the simulated NVML driver (work timed per GPU);
* :mod:`migd.policysim.nodes` - a node's scheduler and the simulator's books beside it;
* :mod:`migd.policysim.runs` - run arithmetic: speed, progress, stop points, restarts;
* :mod:`migd.policysim.matcher` - the nodes' ads and the matcher's ranking;
* :mod:`migd.policysim.usage` - busy/allocated/held/wasted slices over time;
* :mod:`migd.policysim.invariants` - what must hold after every event;
* this module - the event loop (:class:`Simulation`) and the daemon's part around the
  scheduler (submit, apply outcomes, start and end runs).
"""

from __future__ import annotations

import gc
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from migd.core.catalog import geometry
from migd.core.costs import CostModel
from migd.core.gpus import Work
from migd.core.leases import Lease, LeaseState
from migd.core.queueing import QueuedRequest, RequestQueue
from migd.core.scheduler import Outcome as SchedOutcome
from migd.core.states import StateSpace, state_space
from migd.errors import InvalidRequest, RequestTooLarge
from migd.policysim.driver import NvmlDriver, Timed
from migd.policysim.invariants import check_invariants
from migd.policysim.jobs import PowerModel, WorkloadJob
from migd.policysim.matcher import Matcher, lease_for
from migd.policysim.nodes import PoolNode, build_node
from migd.policysim.policies import PolicySpec
from migd.policysim.records import (
    MAX_NODES,
    Attempt,
    JobRecord,
    Outcome,
    PolicySimConfig,
    PolicySimResult,
    ReconfigStats,
    Span,
    index_order,
)
from migd.policysim.runs import Run, StopPoints, interference_model, new_run, next_size, rebalance
from migd.policysim.usage import Usage


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
        self.runs: dict[str, Run] = {}
        # the same runs by (node, GPU): sampling and MPS sharing look at one GPU only
        self._gpu_runs: dict[tuple[int, int], dict[str, Run]] = {}
        self.spans: list[Span] = []
        self.driver = NvmlDriver(CostModel.for_model(self.geo.model), self.spans)
        self.stops = StopPoints(policy)
        self.mps_model = interference_model(self.config.interference, self.config.mps_interference)
        self._events = 0
        self._ended = 0
        self._max_queue = 0
        self.isolation_breaches = 0
        self.notes: list[str] = []
        self._dirty: set[int] = set()
        # leases that ended since the last settle, by node
        self._ended_on: dict[int, list[Lease]] = {}
        self._negotiate = False
        self.nodes = [
            build_node(
                i,
                self.config.gpus,
                geo=self.geo,
                space=self.space,
                policy=policy,
                driver=self.driver,
            )
            for i in range(self.config.nodes)
        ]
        self.ads = Matcher(self.nodes, policy)
        self.queue: RequestQueue[Attempt] | None = None  # the matcher's queue (a pool)
        if self.config.nodes > 1 or policy.static_layout is not None:
            sched = policy.scheduler
            # The policy's own queue scheme, static layouts included, so "(B)" is FIFO
            # for every policy. (HTCondor's negotiator skips jobs that match no slot,
            # i.e. backfills: scheme A is the closer model of a static pool.)
            self.queue = RequestQueue(
                policy=sched.queue,
                aging_s=sched.aging_s,
                starvation_s=sched.starvation_s,
                backfill=sched.backfill,
            )
        self.usage = Usage(self.nodes, self.compute)
        for key in self.usage.timelines:
            self._sample(*key)

    @property
    def timelines(self) -> dict[tuple[int, int], list[tuple[float, float, float, float, float]]]:
        return self.usage.timelines

    @property
    def reconfig(self) -> ReconfigStats:
        return self.driver.reconfig

    # -- event queue -------------------------------------------------------------------------

    def _push(self, when: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), kind, payload))

    def run(self) -> PolicySimResult:
        """Run to completion (or ``max_time_s``) and return the raw result."""
        # A pool run makes millions of short-lived objects while the workload, the nodes
        # and the state spaces live throughout: the collector's full passes would walk
        # those again and again, and they hold no garbage. They are left out for the run
        # (gc.freeze) and young passes run less often; both are restored after.
        threshold = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(100_000, 50, 100)
        try:
            return self._run()
        finally:
            gc.set_threshold(*threshold)
            gc.unfreeze()

    def _run(self) -> PolicySimResult:
        for job in self.jobs:
            attempt = Attempt(job, 0, job.memory_mib, job.min_compute, job.submit_s, job.wait_s)
            self._push(job.submit_s, "arrive", attempt)
        total = len(self.jobs)
        last_report = 0
        handlers: dict[str, Callable[[Any], None]] = {
            "arrive": self._on_arrive,
            "advertise": self._on_advertise,
            "deadline": self._on_deadline,
            "end": self._on_end,
            "idle": self._on_idle,
            "work": self._on_work,
        }
        while self._heap:
            when, _, kind, payload = heapq.heappop(self._heap)
            if when > self.config.max_time_s:
                self.notes.append(f"stopped at max_time_s={self.config.max_time_s:g}")
                break
            self.now = max(self.now, when)
            self._events += 1
            handlers[kind](payload)
            self._settle()
            if self.config.check_invariants:
                self.check_invariants()
            if self.progress is not None and self._ended - last_report >= max(1, total // 50):
                last_report = self._ended
                self.progress(self.now, self._ended, total)
        for run in list(self.runs.values()):
            run.advance(self.now)
        return self._result()

    def _settle(self) -> None:
        """Start jobs whose leases became active; negotiate until nothing changes."""
        for _ in range(1000):
            while self._dirty:
                node = self.nodes[self._dirty.pop()]
                self._activate(node)
                # the daemon drops ended leases once persisted and answered (those the
                # outcomes named ended: no scan of every node's leases)
                for lease in self._ended_on.pop(node.index, ()):
                    node.scheduler.forget(lease.lease_id)
            if not (self._negotiate and self.queue is not None and len(self.queue)):
                self._negotiate = False
                return
            self._negotiate = False
            self.queue.schedule(self.now, self._try_place_item)
            self._max_queue = max(self._max_queue, len(self.queue))
        raise AssertionError("matcher did not settle")  # pragma: no cover

    # -- arrivals and placement ----------------------------------------------------------------

    def _on_arrive(self, attempt: Attempt) -> None:
        record = self.records[attempt.job.job_id]
        record.attempts += 1
        if self.queue is None:
            self._submit_direct(attempt)
            return
        if not any(self.ads.ever_fits(node, attempt) for node in self.nodes):
            self._refuse(attempt, "no partition on any node can ever hold it")
            return
        if attempt.wait_s is not None and attempt.wait_s <= 0:
            if not self._try_place(attempt):
                self._refuse(attempt, "no room at submission (wait_s=0)")
            return
        self.queue.push(
            attempt.lease_id,
            attempt,
            now_s=self.now,
            memory_mib=attempt.memory_mib,
            wait_s=attempt.wait_s,
        )
        self._max_queue = max(self._max_queue, len(self.queue))
        if attempt.wait_s is not None:
            self._push(self.now + attempt.wait_s, "deadline", None)
        self._negotiate = True

    def _submit_direct(self, attempt: Attempt) -> None:
        node = self.nodes[0]
        lease = lease_for(attempt, self.now, attempt.wait_s)
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

    def _reuse_claim(self, node: PoolNode, run: Run) -> None:
        """The schedd keeps the claim on the dynamic slot a finished job leaves and
        starts the user's next idle job that fits the slot's ``VRAM`` there at once,
        before any ad shows the freed memory (``MIGD_START``'s dynamic-slot clause;
        whole-GPU wave in the real pool: the next lease 0.2-0.8 s after the end,
        docs/htcondor-notes.md (r)). Only where ads lag: with ``ad_latency_s = 0`` the
        matcher sees the freed memory at once anyway."""
        if self.queue is None or self.policy.static_layout is not None:
            return
        if self.config.ad_latency_s <= 0:
            return
        uid = run.attempt.job.uid
        for item in self.queue.order(self.now):
            attempt = item.payload
            if attempt.job.uid != uid or attempt.memory_mib > run.limit_mib:
                continue
            if self._submit_now(node, attempt, None):
                self.queue.remove(item.ident)
            return  # one slot, one job

    def _on_advertise(self, node_index: int) -> None:
        """A node's freed memory reaches the matcher (``ad_latency_s`` after it freed it)."""
        node = self.nodes[node_index]
        if node.ad_due is not None and node.ad_due <= self.now:
            self.ads.invalidate(node)
            self._negotiate = True

    def _try_place_item(self, item: QueuedRequest[Attempt]) -> bool:
        return self._try_place(item.payload)

    def _try_place(self, attempt: Attempt) -> bool:
        if self.policy.static_layout is not None:
            slots = self.ads.static_slots(attempt)
            return any(self._submit_now(node, attempt, profile) for node, profile in slots)
        fits = self.ads.fitting_nodes(attempt.memory_mib, attempt.job.uid)
        return any(self._submit_now(node, attempt, None) for node in fits)

    def _submit_now(self, node: PoolNode, attempt: Attempt, profile: str | None) -> bool:
        lease = lease_for(attempt, self.now, 0.0, profile)
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
        if self.queue is not None:
            for item in self.queue.expired(self.now):
                self._refuse(item.payload, "no partition before its deadline")

    # -- scheduler outcomes and NVML work ------------------------------------------------------

    def _apply(self, node: PoolNode, outcome: SchedOutcome, *, placed: bool = False) -> None:
        """Act on a scheduler outcome as the daemon does: run its work (in simulated
        time), and look at the node's leases again (grants start jobs). A node whose
        books changed advertises anew to the matcher: at once when a job was
        ``placed`` on it (its ad shrinks), else after ``ad_latency_s`` (what it frees
        reaches the collector that much later)."""
        if outcome.work or outcome.transitions:
            if placed or self.queue is None or self.config.ad_latency_s <= 0:
                self.ads.invalidate(node)
            elif node.ad_due is None:
                node.ad_due = self.now + self.config.ad_latency_s
                self._push(node.ad_due, "advertise", node.index)
        ended = [lease for lease in outcome.touched if lease.state.terminal]
        if ended:
            self._ended_on.setdefault(node.index, []).extend(ended)
        for work in outcome.work:
            timed = self.driver.execute(node.index, work, self.now)
            if timed is not None:
                done_s, ops = timed
                self._push(done_s, "work", (node.index, work, ops))
                self._sample(node.index, work.gpu)
        self._dirty.add(node.index)

    def _on_work(self, payload: tuple[int, Work, Timed]) -> None:
        node_index, work, timed = payload
        node = self.nodes[node_index]
        created = self.driver.done(node_index, work, timed)
        self._apply(node, node.scheduler.work_done(work, created, self.now, self.now))
        self._sample(node_index, work.gpu)

    def _on_idle(self, node_index: int) -> None:
        node = self.nodes[node_index]
        outcome = node.scheduler.idle_teardown(self.now, self.now)
        if outcome.work:  # (its work places what the torn-down slices make room for)
            self._apply(node, outcome)
            self._negotiate = True

    # -- running jobs --------------------------------------------------------------------------

    def _activate(self, node: PoolNode) -> None:
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

    def _start(self, node: PoolNode, attempt: Attempt, lease: Lease) -> None:
        assert lease.gpu is not None and lease.mode is not None
        gpu = node.scheduler.gpus[lease.gpu]
        record = self.records[attempt.job.job_id]
        if record.first_start_s is None:
            record.first_start_s = self.now
        run, label = new_run(
            attempt,
            node=node.index,
            gpu=gpu.index,
            mode=lease.mode,  # the slice map keeps the granted mode itself
            holding=node.scheduler.mode_ops(gpu).holding(gpu, lease),
            limit_mib=lease.memory_limit_mib or attempt.memory_mib,
            compute=self.compute,
            units=self.geo.units,
            stops=self.stops,
            now_s=self.now,
        )
        record.profiles.append(label)
        if lease.decision is not None and "hybrid" in lease.decision:
            record.hybrid.append(str(lease.decision["hybrid"]))
        self.runs[lease.lease_id] = run
        self._gpu_runs.setdefault((run.node, run.gpu), {})[lease.lease_id] = run
        if run.holding.shared:
            self._count_breaches(lease.lease_id, run)
            self._rebalance_mps(run)
        else:
            self._schedule_end(lease.lease_id, run)
        self._sample(node.index, gpu.index)

    def _schedule_end(self, lease_id: str, run: Run) -> None:
        run.version += 1
        self._push(run.end_s(self.now), "end", (lease_id, run.version))

    def _rebalance_mps(self, run: Run) -> None:
        """Share the MPS device ``run`` is (was) a client of among its clients now."""
        members = [
            (lid, r)
            for lid, r in self._gpu_runs.get((run.node, run.gpu), {}).items()
            if r.shares_device(run)
        ]
        for lid, changed in rebalance(members, self.mps_model, self.compute, self.now):
            self._schedule_end(lid, changed)

    def _count_breaches(self, lease_id: str, run: Run) -> None:
        """Memory isolation: a job that shares an MPS server with another user's job."""
        for lid, other in self._gpu_runs.get((run.node, run.gpu), {}).items():
            if lid != lease_id and other.shares_device(run) and other.uid != run.uid:
                self.isolation_breaches += 1
                return

    def _on_end(self, payload: tuple[str, int]) -> None:
        lease_id, version = payload
        run = self.runs.get(lease_id)
        if run is None or run.version != version:
            return  # superseded by an MPS rebalance
        run.advance(self.now)
        del self.runs[lease_id]
        del self._gpu_runs[(run.node, run.gpu)][lease_id]
        attempt = run.attempt
        record = self.records[attempt.job.job_id]
        self.spans.append(run.span(lease_id, self.now, run.stop))
        node = self.nodes[run.node]
        self._apply(node, node.scheduler.release(lease_id, self.now, self.now, reason=run.stop))
        self._negotiate = True
        if run.stop == "done":
            self._reuse_claim(node, run)
        if run.holding.shared:
            self._rebalance_mps(run)
        sched_policy = node.scheduler.policy
        if run.in_instance and sched_policy.idle_policy == "timeout":
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
        gpu = node.scheduler.gpus[run.gpu]
        bigger = next_size(run, node.scheduler.mode_ops(gpu).restart_room(gpu, run.holding))
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

    # -- bookkeeping -----------------------------------------------------------------------------

    def _sample(self, node_index: int, gpu_index: int) -> None:
        runs = self._gpu_runs.get((node_index, gpu_index), {}).values()
        self.usage.sample(node_index, gpu_index, runs, self.now)

    def check_invariants(self) -> None:
        """Assert what must hold after every event (:mod:`migd.policysim.invariants`)."""
        check_invariants(self.nodes, self._gpu_runs, self.compute)

    def _result(self) -> PolicySimResult:
        self.driver.close(self.now)
        for lease_id, run in self.runs.items():
            self.spans.append(run.span(lease_id, self.now, "unfinished"))
        return PolicySimResult(
            policy=self.policy,
            config=self.config,
            geometry=self.geo,
            records=list(self.records.values()),
            end_s=self.now,
            timelines=self.usage.timelines,
            spans=self.spans,
            reconfig=self.driver.reconfig,
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
    "MAX_NODES",
    "Attempt",
    "JobRecord",
    "Outcome",
    "PolicySimConfig",
    "PolicySimResult",
    "ReconfigStats",
    "Simulation",
    "Span",
    "simulate",
]
