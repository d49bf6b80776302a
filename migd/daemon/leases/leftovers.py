"""Processes that outlive their lease: found when the lease is released, or when the idle
instance is handed out again, and never reused.

A job's child started with ``setsid``, or a ``condor_rm`` that does not reach every
process, keeps its memory on the MIG instance after the job's lease ends. If that
instance went back to the pool, the next lease on it would run out of memory. So
before a release (which schedules queued requests at once) the release path asks
NVML for the processes on the lease's instance; if there are any, the instance is
quarantined (UNEXPLAINED: ``migctl status`` shows it busy with the reason, idle
teardown and the planner leave it alone), the pids are logged and recorded in the
job's history (``migctl explain``), and the reaper's resync adopts the instance again
once they have exited (:meth:`migd.daemon.leases.reconciler.Reconciler.resync_gpu`).

A late orphan (a detached child that creates its CUDA context only after the lease
ended) is not there yet at release. So a grant that reuses an idle instance is checked
too, before its client hears of it (:func:`check_handout`): an instance with processes
is quarantined the same way, the grant is released, and the request is placed again.
"""

from __future__ import annotations

import structlog

from migd.core.gpus import GpuMode
from migd.core.leases import Lease, LeaseState
from migd.daemon.context import DaemonContext
from migd.daemon.leases.executor import GpuExecutor
from migd.daemon.leases.service import LeaseService
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
    _report(leases, lease, "leftover_processes", where, pids, why)
    return pids


async def check_handout(
    ctx: DaemonContext, executor: GpuExecutor, leases: LeaseService, lease: Lease
) -> bool:
    """Whether a just-granted ``lease`` may be handed to its client: ``False`` when the idle
    MIG instance it reuses has processes (a late orphan). The instance is then
    quarantined (UNEXPLAINED, as at release), the grant released (the caller asks again)
    and the pids logged and recorded in the job's history.

    Runs on the GPU's thread through the backend, like every NVML call. Only reused
    instances are checked: a new one has a UUID no process can have known. When NVML
    cannot say, the grant stands (an erroring NVML fails the lease's own work anyway,
    and the reaper's resync finds the processes later).
    """
    if (
        lease.mode is not GpuMode.MIG
        or lease.gpu is None
        or not lease.mig_uuid
        or lease.state is not LeaseState.ACTIVE
        or (lease.decision or {}).get("action") != "reuse"
    ):
        return True
    try:
        procs = await executor.on_gpu(
            lease.gpu, ctx.backend.processes, lease.gpu, lease.mig_uuid, timeout_s=10.0
        )
    except (MigdError, TimeoutError) as exc:
        log.warning(
            "lease.handout_unchecked",
            lease_id=lease.lease_id,
            gpu=lease.gpu,
            error=str(exc),
            reason="NVML could not list the reused instance's processes; granted anyway",
        )
        return True
    pids = sorted({p.pid for p in procs})
    if not pids or lease.state is not LeaseState.ACTIVE:
        return True
    why = (
        f"processes run on it without a migd lease (found when handing it to lease "
        f"{lease.lease_id}): pid {', '.join(map(str, pids))}"
    )
    where = ctx.sched.quarantine(lease.lease_id, why)
    _report(
        leases,
        lease,
        "handout_refused",
        where,
        pids,
        why,
        hint="the request is placed again; the instance is reused once they exit",
    )
    leases.release(lease, f"its instance {where} had processes at hand-out; placed again")
    return False


def _report(
    leases: LeaseService,
    lease: Lease,
    event: str,
    where: str | None,
    pids: list[int],
    why: str,
    **extra: str,
) -> None:
    """A quarantined instance's processes, in the log (``lease.<event>``) and in the
    job's history (``migctl history``): the same fields in both."""
    log.warning(
        f"lease.{event}",
        lease_id=lease.lease_id,
        job_id=lease.request.job_id,
        gpu=lease.gpu,
        instance=where,
        pids=pids,
        reason=why,
        **extra,
    )
    leases.record(event, lease, instance=where, pids=pids, reason=why)
