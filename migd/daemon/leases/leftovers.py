"""Processes that outlive their lease: found before the MIG instance is handed out
again, and never reused.

A job's child started with ``setsid``, or a ``condor_rm`` that does not reach every
process, keeps its memory on the MIG instance after the job's lease ends. If that
instance went to the next lease, that lease would run out of memory (or, worse, two
jobs would share one instance). So every MIG instance is checked for processes once
between two leases, by whichever comes first:

* the hand-out (:meth:`LeftoverChecks.check_handout`): a grant that reuses an idle
  instance asks NVML for its processes before its client hears of it. With any, the
  instance is quarantined (UNEXPLAINED: ``migctl status`` shows it busy with the reason,
  idle teardown and the planner leave it alone), the grant is released and the request
  placed again. This also catches a late orphan, a detached child that creates its
  CUDA context only after the lease ended;
* the sampler's next round (once a second, in the GPU's thread with the memory reads it
  makes anyway; :meth:`LeftoverChecks.plan` and :meth:`LeftoverChecks.apply`), for an
  instance that stays idle: quarantined the same way, so ``migctl status`` and the
  job's history say so within a second even when no lease asks for the instance;
* a teardown: the work runner lists an instance's processes before destroying it and
  refuses with any (:meth:`migd.daemon.leases.work.WorkRunner._execute`); the resync
  that follows makes it UNEXPLAINED and the sampler names the lease.

The release itself makes no NVML call: a lease→release cycle costs one round trip to
the GPU's thread, not two (issue 26 §4: dropping the release's round trip saved 0.43 ms
of the daemon's CPU per cycle on a 2-core node, bench/results/daemon_vs_presplit.md;
bench/gpu_hop.py measures one round trip apart from the daemon). The processes are
named with the lease whose job left them, in the log (``lease.leftover_processes``),
the job's history (``migctl explain``) and the instance's note; the reaper's resync
adopts the instance again once they have exited
(:meth:`migd.daemon.leases.reconciler.Reconciler.resync_gpu`).

Each check applies only to what it read: a hand-out's listing runs in the GPU's thread
after the sampler's that was queued before it, the sampler's verdict stands only for
an instance still idle and for the same ended lease it asked about, and a lease that
holds the instance again leaves the decision to its own hand-out check.
"""

from __future__ import annotations

import structlog

from migd.core.gpus import GpuMode, InstanceStatus, ManagedGpu
from migd.core.leases import Lease, LeaseState
from migd.daemon.context import DaemonContext
from migd.daemon.leases.executor import GpuExecutor
from migd.daemon.leases.service import LeaseService
from migd.errors import MigdError

log = structlog.get_logger("migd")


class LeftoverChecks:
    """MIG instances whose lease ended and that nobody has checked for processes since
    (see the module docstring), and the checks that clear them."""

    def __init__(self, ctx: DaemonContext, executor: GpuExecutor, leases: LeaseService) -> None:
        self.ctx = ctx
        self.executor = executor
        self.leases = leases
        #: MIG device UUID -> the lease that ended on it, not yet checked. At most one per
        #: instance: a later lease's end replaces it (that lease's hand-out checked it).
        self.unchecked: dict[str, Lease] = {}

    def released(self, lease: Lease) -> None:
        """``lease`` is being released by its holder or the JOB_EXIT hook (call before the
        release): its MIG instance is checked by the next hand-out or sampler round."""
        if (
            lease.mode is GpuMode.MIG
            and lease.gpu is not None
            and lease.mig_uuid
            and lease.state is LeaseState.ACTIVE
        ):
            self.unchecked[lease.mig_uuid] = lease

    # -- the sampler's round -----------------------------------------------------------------

    def plan(self, gpu: ManagedGpu) -> dict[str, str]:
        """The idle instances of ``gpu`` to list processes on in this sampler round:
        MIG UUID -> the id of the ended lease it is checked for. Records of instances
        that are gone are dropped (a destroy lists the processes itself)."""
        if not self.unchecked:
            return {}
        present = {i.uuid: i for i in gpu.instances if i.uuid}
        asked: dict[str, str] = {}
        for uuid, lease in list(self.unchecked.items()):
            if lease.gpu != gpu.index:
                continue
            inst = present.get(uuid)
            if inst is None:
                del self.unchecked[uuid]
            elif not inst.lease_ids and inst.status is InstanceStatus.READY:
                asked[uuid] = lease.lease_id
        return asked

    def apply(self, gpu: int, asked: dict[str, str], found: dict[str, list[int] | None]) -> None:
        """The sampler's listing for :meth:`plan`'s ``asked`` (``None``: NVML could not say;
        the next round asks again). Quarantines an instance with processes that is still
        idle and still unchecked for the same lease; one a lease holds again is left to
        that lease's hand-out check."""
        for uuid, lease_id in asked.items():
            lease = self.unchecked.get(uuid)
            pids = found.get(uuid)
            if lease is None or lease.lease_id != lease_id or pids is None:
                continue
            if not pids:
                del self.unchecked[uuid]
                continue
            why = _outlived(lease, pids)
            where = self.ctx.sched.quarantine_idle(gpu, uuid, why)
            if where is None:
                continue  # held again (its hand-out decides), or being destroyed
            del self.unchecked[uuid]
            _report(self.leases, lease, "leftover_processes", where, pids, why)

    # -- the hand-out ------------------------------------------------------------------------

    async def check_handout(self, lease: Lease) -> bool:
        """Whether a just-granted ``lease`` may be handed to its client: ``False`` when the
        idle MIG instance it reuses has processes (left by the lease before, or a late
        orphan). The instance is then quarantined, the grant released (the caller asks
        again) and the pids logged and recorded in the job's history, and in the history
        of the job whose lease ended there unchecked.

        Runs on the GPU's thread through the backend, like every NVML call. Only reused
        instances are checked: a new one has a UUID no process can have known. When NVML
        cannot say, the grant stands (an erroring NVML fails the lease's own work anyway,
        and the reaper's resync finds the processes later).
        """
        if (
            lease.mode is not GpuMode.MIG
            or lease.gpu is None
            or not lease.mig_uuid
            or not _granted(lease)
            or (lease.decision or {}).get("action") != "reuse"
        ):
            return True
        uuid, ctx = lease.mig_uuid, self.ctx
        try:
            procs = await self.executor.on_gpu(
                lease.gpu, ctx.backend.processes, lease.gpu, uuid, timeout_s=10.0
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
        before = self.unchecked.pop(uuid, None)
        pids = sorted({p.pid for p in procs})
        if not pids:
            return True
        if not _granted(lease):
            # Ended while NVML answered: the instance is idle again, the sampler decides.
            if before is not None:
                self.unchecked.setdefault(uuid, before)
            return True
        if before is not None:
            why = _outlived(before, pids)
        else:
            why = (
                f"processes run on it without a migd lease (found when handing it to lease "
                f"{lease.lease_id}): pid {', '.join(map(str, pids))}"
            )
        where = ctx.sched.quarantine(lease.lease_id, why)
        if before is not None:
            _report(self.leases, before, "leftover_processes", where, pids, why)
        _report(
            self.leases,
            lease,
            "handout_refused",
            where,
            pids,
            why,
            hint="the request is placed again; the instance is reused once they exit",
        )
        self.leases.release(lease, f"its instance {where} had processes at hand-out; placed again")
        return False


def _granted(lease: Lease) -> bool:
    # A function, not an inline test: the state is read again after an await.
    return lease.state is LeaseState.ACTIVE


def _outlived(lease: Lease, pids: list[int]) -> str:
    return (
        f"processes outlived lease {lease.lease_id} (job {lease.request.job_id}): "
        f"pid {', '.join(map(str, pids))}"
    )


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
