"""The periodic tasks: reaper, timers, memory sampler and systemd watchdog.

Each task's decisions are a synchronous step over the time it is given (the
:class:`~migd.ports.Clock` the daemon was built with), tested with a manual clock; the
asyncio loops around them only sleep, run the NVML reads a step needs in the GPU's
thread, and call the step (cobald's ``regulate()`` / ``run()`` split):

* reaper (every ``reaper.interval_s``): :meth:`Reaper.holders_gone` picks the leases
  whose holder died or stopped heartbeating; the loop checks their instances for
  processes and reclaims them, starts an MPS housekeeping round, re-reads GPUs that
  need it;
* timers (every second): :meth:`Timers.step` expires queued requests past their
  deadline; every 10 s idle teardown, the demand model's snapshot and pruning; hourly
  the history (at a 10 s round already once it is half again over its budget);
* sampler (every second): :func:`sample_plan` says what to read, the GPU's thread reads
  it (:meth:`Sampler.read`), :meth:`Sampler.apply` books GPU, instance and lease
  memory for status and OOM evidence; the same round lists the processes on idle
  instances whose lease ended unchecked (:class:`LeftoverChecks`), so that check costs
  no round trip of its own;
* watchdog: :meth:`Watchdog.step` feeds systemd only while every GPU thread answers;
* startd (every 2 s, when ``htcondor.offline_gpus``): :class:`OfflineShares` says which
  GPUs HTCondor must stop assigning, :class:`StartdSync` tells the startd in a thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import structlog

from migd.core.condor_shares import OfflineShares
from migd.core.gpus import GpuMode, InstanceStatus, ManagedGpu
from migd.core.lease_end import LeaseEndReason
from migd.core.leases import Lease, LeaseState
from migd.daemon.context import DaemonContext
from migd.daemon.leases.executor import GpuExecutor
from migd.daemon.leases.leftovers import LeftoverChecks
from migd.daemon.leases.reconciler import Reconciler
from migd.daemon.leases.service import LeaseService
from migd.daemon.supervision.mps import MpsSupervisor, known_sum
from migd.errors import MigdError, StartdError, StateStoreError
from migd.ports import StartdControl

log = structlog.get_logger("migd")


class Reaper:
    """Reclaims leases whose holder is gone (also run once by the start-up reconcile)."""

    def __init__(self, ctx: DaemonContext, executor: GpuExecutor, leases: LeaseService) -> None:
        self.ctx = ctx
        self.executor = executor
        self.leases = leases

    def on_transition(
        self, lease: Lease, old: LeaseState | None, new: LeaseState, now: float
    ) -> None:
        """A grant is the lease's first sign of life (a lease observer)."""
        if new is LeaseState.ACTIVE:
            lease.alive_mono_s = self.ctx.clock.monotonic()

    def holders_gone(self, mono: float) -> list[tuple[Lease, str]]:
        """Active leases whose holder process exited, or whose last sign of life is more
        than ``reaper.heartbeat_timeout_s`` (0: no heartbeats needed) ago on the monotonic
        clock ``mono`` (a wall-clock step reclaimed healthy leases), with the reason."""
        ctx = self.ctx
        timeout = ctx.config.reaper.heartbeat_timeout_s
        gone = []
        for lease in ctx.sched.active_leases():
            if lease.state is not LeaseState.ACTIVE:
                continue
            if lease.alive_mono_s is None:  # restored: a full timeout from now to beat
                lease.alive_mono_s = mono
            alive = ctx.procs.alive(lease.owner_pid, lease.owner_start_s)
            stale = timeout > 0 and mono - lease.alive_mono_s > timeout
            if not alive or stale:
                gone.append((lease, "holder process exited" if not alive else "no heartbeat"))
        return gone

    @staticmethod
    def end_of(reason: str) -> LeaseEndReason:
        """The typed end of a reason :meth:`holders_gone` gave."""
        return LeaseEndReason.EXPIRED if reason == "no heartbeat" else LeaseEndReason.HOLDER_GONE

    async def reap(self, now: float, mono: float) -> None:
        """Reclaim leases whose holder is gone; never free an instance processes still use."""
        ctx = self.ctx
        for lease, reason in self.holders_gone(mono):
            still_used = False
            if lease.mode is GpuMode.MIG and lease.mig_uuid and lease.gpu is not None:
                try:
                    still_used = bool(
                        await self.executor.on_gpu(
                            lease.gpu,
                            ctx.backend.processes,
                            lease.gpu,
                            lease.mig_uuid,
                            timeout_s=10.0,
                        )
                    )
                except (MigdError, TimeoutError):
                    still_used = True  # cannot tell: keep it untouchable
            if still_used and lease.gpu is not None:
                # Mark it before the release: the release schedules queued requests, and
                # none of them may be given an instance a dead holder's process still uses.
                # Through the scheduler, so the GPU's books version changes with it (a
                # resync that read the GPU before this must not undo it).
                where = ctx.sched.quarantine(
                    lease.lease_id, f"holder of {lease.lease_id} died but processes remain"
                )
                if where is not None:
                    log.warning("reaper.instance_in_use", gpu=lease.gpu, instance=where)
            self.leases.release(lease, reason, reclaim=True, end=self.end_of(reason))


class Timers:
    """Queue deadlines, idle teardown, the demand snapshot and pruning (see module)."""

    HOUSEKEEPING_EVERY_S = 10.0
    HISTORY_EVERY_S = 3600.0
    #: After a history prune the state disk refused: the next early one no sooner.
    PRUNE_RETRY_S = 600.0
    #: History rows one prune step drops at most: a step holds the event loop ~10 ms,
    #: where a saturated node's whole early prune (50,000 rows and their 16,700 leases)
    #: held it ~0.9 s (bench/results/history_prune.md); the loop serves requests
    #: between two steps.
    PRUNE_STEP_ROWS = 1_000
    #: Between two steps: a lease at saturation, which takes a few turns of the loop,
    #: then meets one step, not one at each turn (back to back, the steps moved the
    #: saturated p99 up 12 %). Still 16,000 rows a second, five times what a saturated
    #: node writes.
    PRUNE_STEP_GAP_S = 0.05
    #: History rows one step of the byte count sums (the first prune after a start, or
    #: after lost writes): ~7 ms, where the whole count held the loop 39-67 ms at
    #: 100,000 rows and 100 ms at 150,000 (bench/results/history_prune.md).
    COUNT_STEP_ROWS = 10_000
    #: Leases one step of the hourly sweep reads: ~9 ms, where the whole sweep held the
    #: loop 63-70 ms at 50,000 leases.
    SWEEP_STEP_ROWS = 5_000

    def __init__(self, ctx: DaemonContext, leases: LeaseService) -> None:
        self.ctx = ctx
        self.leases = leases
        self._next_housekeeping: float | None = None  # monotonic
        self._next_history: float | None = None
        self._early_prune_after = 0.0  # monotonic
        #: A prune under way: its steps count the history's bytes if unknown, drop rows
        #: until none is due, then (the hourly one) sweep the leases table.
        self.pruning = False
        self._sweep = False
        #: Where the sweep under way goes on (a leases rowid; None: not begun).
        self._swept: int | None = None

    def step(self, now: float, mono: float) -> None:
        """One round at wall-clock ``now`` / monotonic ``mono`` (the loop: every second)."""
        ctx, leases, sched = self.ctx, self.leases, self.ctx.sched
        # A failing state disk is retried every round; once it takes writes, the leases
        # changed meanwhile are written (recovery needs no restart).
        leases.flush()
        if self._next_housekeeping is None or self._next_history is None:
            self._next_housekeeping = mono + self.HOUSEKEEPING_EVERY_S
            # The first prune comes with the first housekeeping round, not at the hour: it
            # counts the history's bytes once, in steps (StateStore.count_history_step),
            # and until then only the row budget can tell an early prune is due
            # (StateStore.history_overdue).
            self._next_history = mono + self.HOUSEKEEPING_EVERY_S
        expired = sched.expire(now, mono)  # its outcome places what they blocked
        for lease in expired.ended:
            leases.record("expired", lease, reason=lease.reason)
        leases.apply(expired)
        keep, keep_bytes = ctx.config.daemon.history_keep, ctx.config.daemon.history_keep_bytes
        overdue = False
        if mono >= self._next_housekeeping:
            self._next_housekeeping = mono + self.HOUSEKEEPING_EVERY_S
            leases.apply(sched.idle_teardown(now, mono))
            ctx.db.set_meta("demand", {"counts": sched.demand.snapshot(), "last_s": now})
            leases.prune(all_terminal=True)
            # A busy node passes the history budget long before the hour is up.
            overdue = mono >= self._early_prune_after and ctx.db.history_overdue(keep, keep_bytes)
        hourly = mono >= self._next_history
        if hourly or (overdue and not self.pruning):
            if hourly:
                self._next_history = mono + self.HISTORY_EVERY_S
            self.pruning, self._sweep = True, self._sweep or hourly
        if self.pruning:
            self.prune_step(mono)

    def prune_step(self, mono: float) -> None:
        """One step of the prune under way, each bounded (the timer loop runs the next at
        its loop's next turn while :attr:`pruning`): the history's byte count, when
        unknown (:attr:`COUNT_STEP_ROWS` rows), then at most :attr:`PRUNE_STEP_ROWS`
        history rows dropped, until none is due, then for the hourly prune the sweep of
        the leases table (:attr:`SWEEP_STEP_ROWS` leases)."""
        ctx = self.ctx
        db = ctx.db
        keep, keep_bytes = ctx.config.daemon.history_keep, ctx.config.daemon.history_keep_bytes
        try:
            if not db.count_history_step(self.COUNT_STEP_ROWS):
                return
            if self._swept is None:
                dropped = db.prune(keep, keep_bytes, max_rows=self.PRUNE_STEP_ROWS)
                # (a step that dropped nothing cannot be followed by one that would)
                if dropped > 0 and db.history_due(keep, keep_bytes):
                    return
                if not self._sweep:
                    self.pruning = False
                    return
                self._swept = 0
            self._swept = db.sweep_ended_leases_step(self._swept, self.SWEEP_STEP_ROWS)
            if self._swept is None:
                self.pruning = self._sweep = False
        except StateStoreError as exc:
            # A full or failing state disk: the history stays over its budget, and an
            # early prune at every housekeeping round would only fail again.
            self.pruning = self._sweep = False
            self._swept = None
            self._early_prune_after = mono + self.PRUNE_RETRY_S
            log.warning(
                "history.prune_failed",
                error=exc.message,
                hint=exc.hint,
                retry_s=self.PRUNE_RETRY_S,
            )


class Watchdog:
    """Feeds systemd's watchdog only while every GPU thread is sound.

    Every GPU thread must answer a heartbeat within half the watchdog interval,
    except while NVML work (a create or destroy) younger than
    ``daemon.work_timeout_s`` runs on some GPU: a heartbeat queued behind a slow but
    legitimate creation, in that GPU's thread or behind the driver's lock that
    serialises MIG changes across GPUs, must not get migd killed. A call that hangs
    stops the pings either way: a short call (memory sampling, the reaper) at once,
    a create or destroy when ``work_timeout_s`` ends it (migd then records the
    failure and marks the GPU, see ``WorkRunner.run_work``). systemd restarts migd
    one ``WatchdogSec`` after the last ping; leases survive in the state db.
    """

    def __init__(self, ctx: DaemonContext, executor: GpuExecutor) -> None:
        self.ctx = ctx
        self.executor = executor
        self.interval_s = ctx.notifier.watchdog_s or 20.0
        self.tick_s = self.interval_s / 4
        self.stale_after_s = self.interval_s / 2
        self._due: float | None = None  # when the next step should run

    def started(self, mono: float) -> None:
        """The loop begins: the first step is due one tick from ``mono``."""
        self._due = mono + self.tick_s

    def step(self, mono: float) -> bool:
        """Ping systemd unless a GPU thread is starved or an NVML call hung; True if pinged.

        Two causes of a late answer, told apart and logged as such: a GPU thread that owes
        an answer to a heartbeat (an NVML call hangs: ``watchdog.starved``, no ping), and
        the event loop running this step late (``watchdog.loop_lag``: busy with other
        work, which is not an NVML hang; it runs now, so it pings)."""
        lag = 0.0 if self._due is None else mono - self._due
        self._due = mono + self.tick_s
        stale = self.executor.starved_gpus(self.stale_after_s, mono)
        if stale or self.executor.tripped:
            log.error(
                "watchdog.starved",
                cause="gpu_thread",
                gpus=stale,
                reason=self.executor.tripped or "GPU thread did not answer its heartbeat",
                hint="an NVML call hangs; systemd restarts migd when WatchdogSec passes",
            )
            return False
        if lag > self.tick_s:
            log.warning(
                "watchdog.loop_lag",
                cause="event_loop",
                lag_s=round(lag, 3),
                reason=f"the event loop ran the watchdog {lag:.1f} s late: it was busy, "
                "every GPU thread answers",
                hint="not an NVML hang; if it grows towards WatchdogSec, look for long work "
                "on the loop (debug log, py-spy dump)",
            )
        self.ctx.notifier.watchdog()
        return True


@dataclass
class SamplePlan:
    """What one sampling round reads on a GPU (decided on the event loop)."""

    gpu: int
    instances: list[str] = field(default_factory=list)  # READY instances' UUIDs
    #: MPS devices (None: the whole GPU) -> (lease id, holder pid) of their shares
    shares: dict[str | None, list[tuple[str, int]]] = field(default_factory=dict)
    #: idle instances to list processes on -> the ended lease each is checked for
    #: (LeftoverChecks.plan)
    leftovers: dict[str, str] = field(default_factory=dict)


@dataclass
class SampleReading:
    """What the GPU's thread read for a :class:`SamplePlan` (None: NVML could not say)."""

    gpu_used_mib: int | None
    instance_used_mib: dict[str, int | None] = field(default_factory=dict)
    share_used_mib: dict[str, int | None] = field(default_factory=dict)
    #: the pids on each instance of the plan's ``leftovers``
    leftover_pids: dict[str, list[int] | None] = field(default_factory=dict)


def sample_plan(ctx: DaemonContext, gpu: ManagedGpu) -> SamplePlan:
    plan = SamplePlan(gpu.index)
    plan.instances = [i.uuid for i in gpu.instances if i.uuid and i.status is InstanceStatus.READY]
    for lease in ctx.sched.active_leases():
        if lease.gpu == gpu.index and lease.mode is GpuMode.MPS:
            plan.shares.setdefault(lease.mig_uuid, []).append((lease.lease_id, lease.owner_pid))
    return plan


class Sampler:
    """GPU memory once a second: per GPU and instance for ``migctl status``, and the
    peak of every active lease as OOM evidence for the wrapper, whose own sampling
    misses short jobs. An instance's lease uses the instance, an exclusive lease the
    GPU, an MPS share the memory of its holder's processes on the share's device."""

    def __init__(
        self,
        ctx: DaemonContext,
        leases: LeaseService,
        mps: MpsSupervisor,
        leftovers: LeftoverChecks,
    ) -> None:
        self.ctx = ctx
        self.leases = leases
        self.mps = mps
        self.leftovers = leftovers

    def plan(self, gpu: ManagedGpu) -> SamplePlan:
        """What this round reads on ``gpu`` (on the event loop)."""
        plan = sample_plan(self.ctx, gpu)
        plan.leftovers = self.leftovers.plan(gpu)
        return plan

    def read(self, plan: SamplePlan) -> SampleReading:
        """The NVML reads of a plan (in the GPU's thread; raises what the backend raises)."""
        backend, index = self.ctx.backend, plan.gpu
        reading = SampleReading(backend.memory(index).used_mib)
        for uuid in plan.instances:
            reading.instance_used_mib[uuid] = backend.memory(index, uuid).used_mib
        for device, shares in plan.shares.items():
            procs = backend.processes(index, device)
            for lease_id, holder in shares:
                reading.share_used_mib[lease_id] = known_sum(self.mps.usage(holder, procs))
        for uuid in plan.leftovers:
            try:
                listed: list[int] | None = sorted({p.pid for p in backend.processes(index, uuid)})
            except MigdError:  # this instance only: the next round asks again
                listed = None
            reading.leftover_pids[uuid] = listed
        return reading

    def apply(self, gpu: ManagedGpu, plan: SamplePlan, reading: SampleReading) -> None:
        self.leftovers.apply(gpu.index, plan.leftovers, reading.leftover_pids)
        note_peak = self.leases.note_peak
        gpu.used_mib = reading.gpu_used_mib
        if gpu.exclusive_lease is not None:
            note_peak(gpu.exclusive_lease, reading.gpu_used_mib)
        for inst in gpu.instances:
            if inst.uuid in reading.instance_used_mib:
                inst.used_mib = reading.instance_used_mib[inst.uuid]
                if inst.lease_id is not None and inst.mps_pool is None:
                    note_peak(inst.lease_id, inst.used_mib)
        for lease_id, used in reading.share_used_mib.items():
            note_peak(lease_id, used)


class StartdSync:
    """Keeps the startd's offline GPUs equal to migd's out-of-service ones (see
    :mod:`migd.core.condor_shares`): the decision is :meth:`OfflineShares.step`, the
    port call runs in a thread (HTCondor's tools take a while, and may hang)."""

    def __init__(self, ctx: DaemonContext, startd: StartdControl) -> None:
        self.ctx = ctx
        self.startd = startd
        self.offline = OfflineShares()
        self._last_error = ""

    async def step(self) -> None:
        clock = self.ctx.clock
        wanted = self.offline.step(self.ctx.sched.gpus.values(), clock.monotonic())
        if wanted is None:
            return
        try:
            ids = await asyncio.to_thread(self.startd.set_offline_gpus, wanted)
        except StartdError as exc:
            self.offline.failed(wanted, clock.monotonic())
            if exc.message != self._last_error:  # once per cause, not every retry
                log.warning(
                    "condor.offline_failed",
                    gpus=list(wanted),
                    error=exc.message,
                    hint=exc.hint,
                    retry_s=self.offline.retry_s,
                )
            self._last_error = exc.message
            return
        # (the first round at start, with nothing offline, is no news)
        if wanted or self.offline.written is not None:
            log.info("condor.offline_gpus", gpus=list(wanted), share_ids=len(ids))
        self.offline.applied(wanted)
        self._last_error = ""


class PeriodicTasks:
    """The daemon's background loops: thin asyncio around the steps above."""

    def __init__(
        self,
        ctx: DaemonContext,
        executor: GpuExecutor,
        leases: LeaseService,
        reaper: Reaper,
        reconciler: Reconciler,
        mps: MpsSupervisor,
        leftovers: LeftoverChecks,
        startd: StartdControl | None = None,
    ) -> None:
        self.ctx = ctx
        self.executor = executor
        self.leases = leases
        self.reaper = reaper
        self.reconciler = reconciler
        self.mps = mps
        self.timers = Timers(ctx, leases)
        self.sampler = Sampler(ctx, leases, mps, leftovers)
        self.startd = StartdSync(ctx, startd) if startd is not None else None

    def start(self) -> list[asyncio.Task[None]]:
        tasks = [
            asyncio.create_task(self.reaper_loop(), name="reaper"),
            asyncio.create_task(self.timer_loop(), name="timers"),
            asyncio.create_task(self.watchdog_loop(), name="watchdog"),
            asyncio.create_task(self.sampler_loop(), name="sampler"),
        ]
        if self.startd is not None:
            tasks.append(asyncio.create_task(self.startd_loop(self.startd), name="startd"))
        return tasks

    async def reaper_loop(self) -> None:
        ctx = self.ctx
        while True:
            await asyncio.sleep(ctx.config.reaper.interval_s)
            try:
                await self.reaper_round()
            except Exception as exc:
                log.exception("reaper.crashed", error=str(exc))

    async def reaper_round(self) -> None:
        """One round of the reaper loop (the interleaving tests step it directly)."""
        ctx = self.ctx
        now, mono = ctx.now()
        await self.reaper.reap(now, mono)
        self.mps.kick_housekeeping()
        for gpu in list(ctx.sched.gpus.values()):
            if self.reconciler.needs_resync(gpu):
                for note in await self.reconciler.resync_gpu(gpu.index):
                    log.info("resync", gpu=gpu.index, note=note)
                self.reconciler.forget_explained(gpu.index)
                # Judged afresh, the GPU may take work again: place what fits.
                now, mono = ctx.now()
                self.leases.apply(ctx.sched.schedule(now, mono))

    async def timer_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                self.timers.step(*self.ctx.now())
                await self.finish_prune()
            except Exception as exc:
                log.exception("timers.crashed", error=str(exc))

    async def finish_prune(self) -> None:
        """The steps left of a history prune a timer step began, the loop serving
        requests between two (:attr:`Timers.PRUNE_STEP_GAP_S`): a request waits for one
        step (~10 ms), not for the whole prune."""
        timers = self.timers
        while timers.pruning:
            await asyncio.sleep(timers.PRUNE_STEP_GAP_S)
            timers.prune_step(self.ctx.clock.monotonic())

    async def sampler_loop(self) -> None:
        """Reads may degrade to unknown; the first round runs at once, so status shows
        memory from the start."""
        while True:
            for gpu in list(self.ctx.sched.gpus.values()):
                if gpu.mode is GpuMode.OFF or gpu.index not in self.executor.workers:
                    continue
                try:
                    await self.sample_round(gpu)
                except Exception as exc:  # sampling must outlive any surprise
                    log.exception("sampler.crashed", gpu=gpu.index, error=str(exc))
            await asyncio.sleep(1.0)

    async def sample_round(self, gpu: ManagedGpu) -> None:
        """One GPU's sampling round (the interleaving tests step it directly)."""
        plan = self.sampler.plan(gpu)
        try:
            reading = await self.executor.on_gpu(gpu.index, self.sampler.read, plan, timeout_s=10.0)
        except (MigdError, TimeoutError):
            gpu.used_mib = None
            return
        self.sampler.apply(gpu, plan, reading)

    async def startd_loop(self, sync: StartdSync) -> None:
        while True:
            try:
                await sync.step()
            except Exception as exc:
                log.exception("startd.crashed", error=str(exc))
            await asyncio.sleep(2.0)

    async def watchdog_loop(self) -> None:
        watchdog = Watchdog(self.ctx, self.executor)
        if self.ctx.notifier.watchdog_s:
            log.info(
                "watchdog.enabled",
                watchdog_s=watchdog.interval_s,
                ping_every_s=watchdog.tick_s,
                heartbeat_stale_after_s=watchdog.stale_after_s,
                work_timeout_s=self.ctx.config.daemon.work_timeout_s,
            )
        watchdog.started(self.ctx.clock.monotonic())
        while True:
            self.executor.send_heartbeats()
            await asyncio.sleep(watchdog.tick_s)
            watchdog.step(self.ctx.clock.monotonic())
