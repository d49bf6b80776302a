"""Processes that outlive their lease: found when the lease is released, never reused.

A job's child started with ``setsid``, or a ``condor_rm`` that does not reach every
process, keeps its memory on the MIG instance after the job's lease ends. If that
instance went back to the pool, the next lease on it would run out of memory. So
before a release (which schedules queued requests at once) the release path asks
NVML for the processes on the lease's instance; if there are any, the instance is
quarantined (UNEXPLAINED: ``migctl status`` shows it busy with the reason, idle
teardown and the planner leave it alone), the pids are logged and recorded in the
job's history (``migctl explain``), and the reaper's resync adopts the instance again
once they have exited (:meth:`migd.daemon.reconciler.Reconciler.resync_gpu`).
"""

from __future__ import annotations

import structlog

from migd.core.leases import LeaseState
from migd.core.scheduler import Lease
from migd.daemon.context import DaemonContext
from migd.daemon.executor import GpuExecutor
from migd.daemon.lease_service import LeaseService
from migd.errors import MigdError

log = structlog.get_logger("migd")


async def quarantine_leftovers(
    ctx: DaemonContext, executor: GpuExecutor, leases: LeaseService, lease: Lease
) -> list[int]:
    """Quarantine ``lease``'s MIG instance if processes still run on it (call before
    releasing the lease). Returns their pids; ``[]`` when none or no MIG instance.

    When NVML cannot say (an error, a timeout), the instance is quarantined too, as the
    reaper does: the resync decides later, reusing it blindly could hand out memory a
    process still holds.
    """
    if (
        lease.mode != "mig"
        or lease.gpu is None
        or not lease.mig_uuid
        or lease.state is not LeaseState.ACTIVE
    ):
        return []
    why: str
    try:
        procs = await executor.on_gpu(
            lease.gpu, ctx.backend.processes, lease.gpu, lease.mig_uuid, timeout_s=10.0
        )
    except (MigdError, TimeoutError) as exc:
        pids: list[int] = []
        why = f"cannot tell whether processes outlived lease {lease.lease_id}: {exc}"
    else:
        pids = sorted({p.pid for p in procs})
        if not pids:
            return []
        why = (
            f"processes outlived lease {lease.lease_id} (job {lease.request.job_id}): "
            f"pid {', '.join(map(str, pids))}"
        )
    where = ctx.sched.quarantine(lease.lease_id, why)
    if where is None:
        return pids
    log.warning(
        "lease.leftover_processes",
        lease_id=lease.lease_id,
        job_id=lease.request.job_id,
        gpu=lease.gpu,
        instance=where,
        pids=pids,
        reason=why,
    )
    leases.record("leftover_processes", lease, instance=where, pids=pids, reason=why)
    return pids
