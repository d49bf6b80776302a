"""The periodic tasks: reaper, timers, memory sampler and systemd watchdog.

* reaper (every ``reaper.interval_s``): reclaim leases whose holder died or stopped
  heartbeating, start an MPS housekeeping round, re-read GPUs that need it;
* timers (every second): queue deadlines; every 10 s idle teardown, the demand model's
  snapshot and pruning; hourly the history;
* sampler (every second): GPU, instance and lease memory for status and OOM evidence;
* watchdog: feed systemd only while every GPU thread answers.
"""

from __future__ import annotations

import asyncio

import structlog

from migd.core.leases import LeaseState
from migd.core.scheduler import GpuMode, InstanceStatus, Lease, ManagedGpu, Origin
from migd.daemon.context import DaemonContext
from migd.daemon.executor import GpuExecutor
from migd.daemon.lease_service import LeaseService
from migd.daemon.mps_supervisor import MpsSupervisor
from migd.daemon.reconciler import Reconciler
from migd.errors import MigdError
from migd.ports import GpuProcess

log = structlog.get_logger("migd")


class Reaper:
    """Reclaims leases whose holder is gone (also run once by the start-up reconcile)."""

    def __init__(self, ctx: DaemonContext, executor: GpuExecutor, leases: LeaseService) -> None:
        self.ctx = ctx
        self.executor = executor
        self.leases = leases

    async def reap(self, now: float, mono: float) -> None:
        """Reclaim leases whose holder is gone; never free an instance processes still use."""
        ctx = self.ctx
        timeout = ctx.config.reaper.heartbeat_timeout_s
        for lease in list(ctx.sched.active_leases()):
            if lease.state is not LeaseState.ACTIVE:
                continue
            alive = ctx.procs.alive(lease.owner_pid, lease.owner_start_s)
            stale = timeout > 0 and (now - (lease.heartbeat_s or lease.updated_s)) > timeout
            if alive and not stale:
                continue
            reason = "holder process exited" if not alive else "no heartbeat"
            still_used = False
            if lease.mode == "mig" and lease.mig_uuid and lease.gpu is not None:
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
                inst = ctx.sched.gpus[lease.gpu].instance_of(lease.lease_id)
                if inst is not None:
                    inst.origin = Origin.UNEXPLAINED
                    inst.note = f"holder of {lease.lease_id} died but processes remain"
                    log.warning("reaper.instance_in_use", gpu=lease.gpu, instance=str(inst))
            self.leases.release(lease, reason, reclaim=True)


class PeriodicTasks:
    """The daemon's background loops (see the module docstring)."""

    def __init__(
        self,
        ctx: DaemonContext,
        executor: GpuExecutor,
        leases: LeaseService,
        reaper: Reaper,
        reconciler: Reconciler,
        mps: MpsSupervisor,
    ) -> None:
        self.ctx = ctx
        self.executor = executor
        self.leases = leases
        self.reaper = reaper
        self.reconciler = reconciler
        self.mps = mps

    def start(self) -> list[asyncio.Task[None]]:
        return [
            asyncio.create_task(self.reaper_loop(), name="reaper"),
            asyncio.create_task(self.timer_loop(), name="timers"),
            asyncio.create_task(self.watchdog_loop(), name="watchdog"),
            asyncio.create_task(self.sampler_loop(), name="sampler"),
        ]

    async def reaper_loop(self) -> None:
        ctx = self.ctx
        while True:
            await asyncio.sleep(ctx.config.reaper.interval_s)
            now, mono = ctx.now()
            try:
                await self.reaper.reap(now, mono)
                self.mps.kick_housekeeping()
                for gpu in list(ctx.sched.gpus.values()):
                    if self.reconciler.needs_resync(gpu):
                        for note in await self.reconciler.resync_gpu(gpu.index):
                            log.info("resync", gpu=gpu.index, note=note)
                        # Judged afresh, the GPU may take work again: place what fits.
                        self.leases.apply(ctx.sched.schedule(now, mono))
            except Exception as exc:
                log.exception("reaper.crashed", error=str(exc))

    async def timer_loop(self) -> None:
        """Queue deadlines, idle teardown, re-checks of unexplained instances, pruning."""
        ctx, leases = self.ctx, self.leases
        tick = 0
        while True:
            await asyncio.sleep(1.0)
            tick += 1
            now, mono = ctx.now()
            sched = ctx.sched
            try:
                expired = sched.expire(now, mono)
                for lease in expired.ended:
                    leases.record("expired", lease, reason=lease.reason)
                leases.apply(expired)
                if tick % 10 == 0:
                    leases.apply(sched.idle_teardown(now, mono))
                    ctx.db.set_meta("demand", {"counts": sched.demand.snapshot(), "last_s": now})
                    leases.prune(all_terminal=True)
                if tick % 3600 == 0:
                    ctx.db.prune(ctx.config.daemon.history_keep)
            except Exception as exc:
                log.exception("timers.crashed", error=str(exc))

    async def sampler_loop(self) -> None:
        """GPU memory once a second: per GPU and instance for ``migctl status``, and the
        peak of every active lease as OOM evidence for the wrapper, whose own sampling
        misses short jobs. Reads may degrade to unknown; the first round runs at once,
        so status shows memory from the start."""
        while True:
            for gpu in list(self.ctx.sched.gpus.values()):
                if gpu.mode is GpuMode.OFF or gpu.index not in self.executor.workers:
                    continue
                try:
                    await self._sample_gpu(gpu)
                except (MigdError, TimeoutError):
                    gpu.used_mib = None
                except Exception as exc:  # sampling must outlive any surprise
                    log.exception("sampler.crashed", gpu=gpu.index, error=str(exc))
            await asyncio.sleep(1.0)

    async def _sample_gpu(self, gpu: ManagedGpu) -> None:
        """One GPU's memory, its instances', and its leases' peaks: an instance's lease
        uses the instance, an exclusive lease the GPU, an MPS share the memory of its
        holder's processes on the share's device."""
        on_gpu, backend, note_peak = self.executor.on_gpu, self.ctx.backend, self.leases.note_peak
        index = gpu.index
        memory = await on_gpu(index, backend.memory, index, timeout_s=10.0)
        gpu.used_mib = memory.used_mib
        if gpu.exclusive_lease is not None:
            note_peak(gpu.exclusive_lease, memory.used_mib)
        for inst in gpu.instances:
            if inst.uuid and inst.status is InstanceStatus.READY:
                mem = await on_gpu(index, backend.memory, index, inst.uuid, timeout_s=10.0)
                inst.used_mib = mem.used_mib
                if inst.lease_id is not None and inst.mps_pool is None:
                    note_peak(inst.lease_id, mem.used_mib)
        shares: dict[str | None, list[Lease]] = {}
        for lease in self.ctx.sched.active_leases():
            if lease.gpu == index and lease.mode == "mps":
                shares.setdefault(lease.mig_uuid, []).append(lease)
        for device, leases in shares.items():
            procs = await on_gpu(index, backend.processes, index, device, timeout_s=10.0)
            for lease in leases:
                mine = await on_gpu(index, self.mps.usage, lease, procs, timeout_s=10.0)
                note_peak(lease.lease_id, known_sum(mine))

    async def watchdog_loop(self) -> None:
        """Feed systemd's watchdog only while every GPU thread is sound.

        Every GPU thread must answer a heartbeat within half the watchdog interval,
        except while NVML work (a create or destroy) younger than
        ``daemon.work_timeout_s`` runs on some GPU: a heartbeat queued behind a slow but
        legitimate creation, in that GPU's thread or behind the driver's lock that
        serialises MIG changes across GPUs, must not get migd killed. A call that hangs
        stops the pings either way: a short call (memory sampling, the reaper) at once,
        a create or destroy when ``work_timeout_s`` ends it (migd then records the
        failure and marks the GPU, see ``GpuExecutor.run_work``). systemd restarts migd
        one ``WatchdogSec`` after the last ping; leases survive in the state db.
        """
        notifier = self.ctx.notifier
        interval = notifier.watchdog_s or 20.0
        tick, stale_after = interval / 4, interval / 2
        if notifier.watchdog_s:
            log.info(
                "watchdog.enabled",
                watchdog_s=interval,
                ping_every_s=tick,
                heartbeat_stale_after_s=stale_after,
                work_timeout_s=self.ctx.config.daemon.work_timeout_s,
            )
        while True:
            self.executor.send_heartbeats()
            await asyncio.sleep(tick)
            stale = self.executor.starved_gpus(stale_after)
            if stale or self.executor.tripped:
                log.error(
                    "watchdog.starved",
                    gpus=stale,
                    reason=self.executor.tripped or "GPU thread did not answer",
                    hint="an NVML call hangs; systemd restarts migd when WatchdogSec passes",
                )
                continue
            notifier.watchdog()


def known_sum(procs: list[GpuProcess]) -> int | None:
    """Memory of these processes, or None when NVML could not say for any of them."""
    known = [p.used_mib for p in procs if p.used_mib is not None]
    return sum(known) if known else None
