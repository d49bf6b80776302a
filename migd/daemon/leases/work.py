"""Running the scheduler's work items: each GPU's loop takes the items
:meth:`~migd.daemon.leases.executor.GpuExecutor.dispatch` queued and runs their NVML
operations in the GPU's thread, then reports the result to the scheduler and hands the
outcome to the lease service.

Built last of the lease parts, with everything it calls: the executor (threads and
queues), the lease service, the reconciler's GPU resync (after failed work) and the MPS
supervisor's stop before an instance is destroyed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import structlog

from migd.core.gpus import InstanceStatus, Work
from migd.core.health import HealthSource
from migd.core.leases import LeaseState
from migd.core.planner import CreateOp, DestroyOp
from migd.daemon.context import DaemonContext
from migd.daemon.leases.executor import GpuExecutor
from migd.daemon.leases.service import LeaseService
from migd.errors import GpuBusy, GpuError, MigdError, StateDiskError

log = structlog.get_logger("migd")


class WorkRunner:
    """Each GPU's work loop (see the module docstring).

    Args:
        resync: re-reads a GPU after failed work (the reconciler's).
        before_destroy: runs in the GPU's thread before an instance is destroyed (the MPS
            supervisor's: its server is a process on the instance too).
    """

    def __init__(
        self,
        ctx: DaemonContext,
        executor: GpuExecutor,
        leases: LeaseService,
        resync: Callable[[int], Awaitable[list[str]]],
        before_destroy: Callable[[int, str | None], None],
    ) -> None:
        self.ctx = ctx
        self.executor = executor
        self.leases = leases
        self.resync = resync
        self.before_destroy = before_destroy

    # -- running work -----------------------------------------------------------------------

    async def gpu_loop(self, index: int) -> None:
        worker = self.executor.workers[index]
        while True:
            work = await worker.queue.get()
            worker.busy_since_mono = self.ctx.clock.monotonic()
            try:
                await self.run_work(work)
            except Exception as exc:  # keep the loop alive whatever happens
                log.exception("work.crashed", gpu=index, error=str(exc))
            finally:
                worker.busy_since_mono = None

    async def run_work(self, work: Work) -> None:
        ctx, leases = self.ctx, self.leases
        sched = ctx.sched
        if not sched.work_is_current(work):
            log.info(
                "work.skipped",
                gpu=work.gpu,
                ops=[str(op) for op in work.ops],
                reason="an earlier operation on this GPU failed",
            )
            leases.apply(sched.work_failed(work, GpuError("obsolete"), ctx.clock.now()))
            return
        gpu = sched.gpus[work.gpu]
        targets: dict[int, tuple[int | None, str | None]] = {}
        for op in work.ops:
            if isinstance(op, DestroyOp):
                inst = gpu.instance_at(op.start, InstanceStatus.DESTROYING)
                targets[op.start] = (inst.gi_id, inst.uuid) if inst else (None, None)
        lease = sched.leases.get(work.lease_id or "")
        started = ctx.clock.monotonic()
        try:
            for op in work.ops:
                if isinstance(op, CreateOp):
                    # Written before the NVML call: after a crash mid-create, a GPU instance
                    # without a compute instance at this start is known to be migd's own.
                    # A state disk that refuses it fails the work (StateDiskError) before
                    # NVML is touched, so the books give the capacity back.
                    ctx.db.remember_instance(gpu.uuid, op.start, op.profile.profile_id, None)
            created = await self.executor.on_gpu(work.gpu, self._execute, work, targets)
        except (MigdError, TimeoutError) as exc:
            error = exc if isinstance(exc, MigdError) else GpuError("NVML call timed out")
            now, mono = ctx.now()
            # Until the resync below has read the GPU, its books are not the truth (part
            # of the work may have happened): it takes no new placement meanwhile. The
            # resync judges this condition afresh; a deferred one leaves it to the reaper.
            gpu.health.raise_(
                HealthSource.RESYNC, f"re-reading the GPU after failed work: {error}", now
            )
            leases.apply(sched.work_failed(work, error, now))
            log.warning(
                "work.failed",
                gpu=work.gpu,
                ops=[str(op) for op in work.ops],
                error=str(error),
                lease_id=work.lease_id,
            )
            leases.record(
                "work.failed",
                lease,
                gpu=work.gpu,
                ops=[str(o) for o in work.ops],
                error=error.to_dict(),
            )
            if isinstance(exc, TimeoutError):
                self.executor.tripped = "an NVML call hung; the watchdog will restart migd"
                gpu.health.raise_(HealthSource.WATCHDOG, self.executor.tripped, now)
                return
            for note in await self.resync(work.gpu):
                log.info("resync", gpu=work.gpu, note=note)
            # The GPU's books were not trusted until it was re-read: place what fits now.
            leases.apply(sched.schedule(now, mono))
            return
        now, mono = ctx.now()
        outcome = sched.work_done(work, created, now, mono)
        # The work is done on the GPU whatever the state disk says: a row that cannot be
        # written only makes a restart call the instance adopted instead of migd's own.
        with contextlib.suppress(StateDiskError):
            for op in work.ops:
                if isinstance(op, DestroyOp):
                    ctx.db.forget_instance(gpu.uuid, op.start)
                else:
                    ctx.db.remember_instance(
                        gpu.uuid, op.start, op.profile.profile_id, created[op.start][1]
                    )
        elapsed = ctx.clock.monotonic() - started
        log.info(
            "work.done",
            gpu=work.gpu,
            kind=work.kind,
            ops=[str(op) for op in work.ops],
            seconds=round(elapsed, 3),
            lease_id=work.lease_id,
        )
        if lease is not None and lease.state is LeaseState.ACTIVE:
            leases.work_seconds[lease.lease_id] = round(elapsed, 3)  # for the grant's record
        elif work.kind == "teardown":
            leases.record("teardown", None, gpu=work.gpu, ops=[str(o) for o in work.ops])
        leases.apply(outcome)

    def _execute(
        self, work: Work, targets: dict[int, tuple[int | None, str | None]]
    ) -> dict[int, tuple[int | None, str | None, int]]:
        """Run a work item's NVML operations in order (in the GPU's thread)."""
        backend = self.ctx.backend
        created: dict[int, tuple[int | None, str | None, int]] = {}
        # Every instance the item destroys is checked before any is destroyed: a refusal
        # then leaves the GPU as the books had it before the work (work_failed puts the
        # instances back), not with some of them gone.
        gi_ids: dict[int, int] = {}
        for op in work.ops:
            if isinstance(op, DestroyOp):
                gi_id, uuid = targets[op.start]
                if gi_id is None:
                    raise GpuError(f"cannot destroy {op.profile.name}@{op.start}: unknown GI id")
                self.before_destroy(work.gpu, uuid)  # its MPS server is a process too
                if uuid and backend.processes(work.gpu, uuid):
                    # Never destroy an instance a process uses, whatever our books say.
                    raise GpuBusy(f"{op.profile.name}@{op.start} has processes; not destroying it")
                gi_ids[op.start] = gi_id
        for op in work.ops:
            if isinstance(op, DestroyOp):
                backend.destroy_instance(work.gpu, gi_ids[op.start])
            elif isinstance(op, CreateOp):
                inst = backend.create_instance(work.gpu, op.profile.profile_id, op.start)
                created[op.start] = (inst.gi_id, inst.uuid, inst.memory_total_mib)
        return created
