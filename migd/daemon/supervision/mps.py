"""The MPS supervisor: migd's side of the per-device MPS control daemons.

Starts a lease's share on its device (and releases it), adopts daemons an earlier migd
left running, flags the leases whose clients died with a daemon, runs the periodic
housekeeping (restart dead daemons, stop idle ones, refresh their status) off the event
loop, and stops a MIG instance's daemon before the instance is destroyed. The daemons
themselves are driven through :class:`migd.ports.MpsControl`.

Where the driver supports MPS v3 memory partitioning (detection through
:class:`migd.ports.CgroupMemoryLimits`, ``mps.cgroup_limits = "auto"``), a share's memory
is also set as its job cgroup's hard limit when the share starts, and cleared at release;
a failure there is a log line and a status note, never a failed lease (the pinned
per-process limit stays).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog

from migd.core.gpus import GpuMode, ManagedGpu
from migd.core.health import HealthSource
from migd.core.lease_end import LeaseEndReason
from migd.core.leases import Lease, LeaseState
from migd.core.mps import (
    AppliedCgroupLimit,
    CgroupLimitAction,
    CgroupSupport,
    DeviceKind,
    MpsPool,
    MpsShare,
    cgroup_limit_decision,
)
from migd.core.scheduler import default_mps_env
from migd.daemon.context import DaemonContext
from migd.daemon.leases.executor import GpuExecutor
from migd.daemon.leases.service import LeaseService
from migd.errors import MigdError
from migd.ports import CgroupMemoryLimits, GpuInfo, GpuProcess, MpsControl, MpsHealthReport

log = structlog.get_logger("migd")
#: GPU health while an MPS daemon on it cannot be brought back (cleared once it serves).
MPS_UNHEALTHY = "MPS daemon cannot be restarted"


def mps_compute_mode_warning(info: GpuInfo) -> str:
    """Why MPS on this GPU is weaker than NVIDIA's recipe ("" when it is not).

    NVIDIA's MPS recipe, its device plugin (``cmd/mps-control-daemon/mps/daemon.go``) and
    its DRA driver (``sharing.go``) put MPS GPUs in EXCLUSIVE_PROCESS compute mode; migd
    only reads it (``GpuInfo.compute_mode``).
    """
    if info.compute_mode == "EXCLUSIVE_PROCESS":
        return ""
    mode = info.compute_mode or "unknown"
    return (
        f"compute mode is {mode}, not EXCLUSIVE_PROCESS: a job that unsets "
        f"CUDA_MPS_PIPE_DIRECTORY runs outside MPS without a memory limit "
        f"(`nvidia-smi -i {info.index} -c EXCLUSIVE_PROCESS`)"
    )


def cgroup_limits_status(ctx: DaemonContext, pool: MpsPool) -> dict[str, Any]:
    """Whether per-job (cgroup) limits are in force on an MPS device, and why not."""
    return ctx.cgroup_book.device_status(
        pool.device_uuid, setting=ctx.config.mps.cgroup_limits, kind=pool.kind
    )


def known_sum(procs: list[GpuProcess]) -> int | None:
    """Memory of these processes (an MPS holder's), or None when NVML could not say for
    any of them."""
    known = [p.used_mib for p in procs if p.used_mib is not None]
    return sum(known) if known else None


class ShareRelease:
    """Drops a released lease's MPS share, in its GPU's thread, and clears its job
    cgroup's limit (HTCondor removing the cgroup clears it too): the lease service's
    ``release_share``. Apart from :class:`MpsSupervisor`, which acts on leases, so that
    the lease service is built before it, with this."""

    def __init__(self, ctx: DaemonContext, executor: GpuExecutor) -> None:
        self.ctx = ctx
        self.executor = executor

    def __call__(self, gpu: int, device_uuid: str, lease_id: str) -> None:
        if self.ctx.mps is not None:
            self.executor.run_detached(gpu, self.ctx.mps.release_share, device_uuid, lease_id)
        applied = self.ctx.cgroup_book.applied.pop(lease_id, None)
        if applied is not None and self.ctx.cgroup_limits is not None:
            self.executor.run_detached(gpu, clear_cgroup, self.ctx.cgroup_limits, applied)


def clear_cgroup(port: CgroupMemoryLimits, applied: AppliedCgroupLimit) -> None:
    try:
        port.clear_limit(applied.gpu, applied.cgroup)
    except MigdError as exc:  # a cgroup already removed has no limit left to clear
        log.warning("mps.cgroup_clear_failed", cgroup=applied.cgroup, error=exc.message)
    else:
        log.info("mps.cgroup_limit_cleared", cgroup=applied.cgroup)


class MpsSupervisor:
    """See the module docstring. ``ctx.mps`` is ``None`` when migd runs no MPS daemons;
    every method is then a no-op (or the plain environment)."""

    def __init__(self, ctx: DaemonContext, executor: GpuExecutor, leases: LeaseService) -> None:
        self.ctx = ctx
        self.executor = executor
        self.leases = leases
        self._task: asyncio.Task[None] | None = None  # a running housekeeping round
        self._adopted_at_start: tuple[str, ...] = ()  # MPS devices found alive
        self._lost_at_start: tuple[str, ...] = ()  # ... and found dead, at start-up

    @property
    def mps(self) -> MpsControl | None:
        return self.ctx.mps

    # -- GPU set-up -------------------------------------------------------------------------

    def configure(
        self, gpu: ManagedGpu, info: GpuInfo, mps_in_mig: bool, mps_profile: str | None
    ) -> None:
        """MPS settings of a GPU: MPS inside MIG instances, and its compute slices.

        With ``mps.require_exclusive_process``, a GPU not in EXCLUSIVE_PROCESS compute
        mode gets no MPS: an MPS GPU is reported unhealthy (no work), a MIG GPU hosts no
        MPS instances. Without that mode a job that unsets ``CUDA_MPS_PIPE_DIRECTORY``
        runs outside MPS, without a memory limit (docs/operations.md).
        """
        if gpu.space is not None:
            gpu.compute_slices = gpu.space.geometry.compute_slices
        elif gpu.mode is GpuMode.MPS:
            with contextlib.suppress(MigdError):  # a MIG-capable model used whole
                gpu.compute_slices = self.ctx.backend.geometry(info.index).compute_slices
        weak = mps_compute_mode_warning(info)
        if weak and self.ctx.config.mps.require_exclusive_process:
            if gpu.mode is GpuMode.MPS:
                gpu.health.raise_(
                    HealthSource.STARTUP,
                    f"{weak}; mps.require_exclusive_process keeps MPS off it",
                    self.ctx.clock.now(),
                )
            if mps_in_mig and gpu.mode is GpuMode.MIG:
                log.warning("mps.not_offered", gpu=info.index, reason=weak)
            return
        mig = gpu.mig
        if not mps_in_mig or mig is None:
            return
        mig.mps_in_mig = True
        if mps_profile and mig.space is not None:
            try:
                mig.mps_profile = mig.space.member(mps_profile).name
            except MigdError as exc:
                reason = f"mps_profile {mps_profile!r}: {exc.message}"
                gpu.health.raise_(HealthSource.STARTUP, reason, self.ctx.clock.now())

    def env(self, gpu: ManagedGpu, lease: Lease) -> dict[str, str]:
        """The job environment of an MPS share (the scheduler's ``mps_env``): the core's,
        with the pipe and log directories of migd's daemon for the device."""
        env = default_mps_env(gpu, lease)
        if self.mps is not None:
            env.update(self.mps.client_env(lease.mig_uuid or gpu.uuid, lease))
        return env

    async def start(self) -> None:
        """Adopt the daemons an earlier migd left (at start-up, before reconciling)."""
        if self.mps is None:
            return
        try:
            report = await asyncio.get_running_loop().run_in_executor(None, self.mps.start)
        except MigdError as exc:
            log.error("mps.start_failed", error=exc.message, hint=exc.hint)
            return
        for uuid in report.adopted:
            self.ctx.notes.append(f"adopted the MPS daemon of {uuid}")
        for uuid in report.lost:
            self.ctx.notes.append(f"the MPS daemon of {uuid} had died while migd was down")
        self._adopted_at_start = tuple(report.adopted)
        self._lost_at_start = tuple(report.lost)

    async def reattach(self) -> None:
        """Register restored MPS leases with their (adopted or restarted) control daemons.

        A lease whose daemon died while migd was down lost its CUDA clients with it: it is
        flagged (and the loss recorded) before a new daemon is started for it.
        """
        if self.mps is None:
            return
        lost = set(self._lost_at_start)
        for uuid in sorted(lost):
            self.clients_lost(uuid, "its MPS control daemon died while migd was down")
        adopted = set(self._adopted_at_start)
        for lease in self.ctx.sched.active_leases():
            device = lease.mps_device_uuid
            if device is not None and device not in adopted and device not in lost:
                # No daemon was found at all (not even a dead one's record): flag it too.
                lease.warn(
                    "MPS clients may be lost: no MPS control daemon was running for it when "
                    "migd started",
                    self.ctx.clock.now(),
                )
                self.leases.save(lease)
                self.leases.record("mps.clients_lost", lease, device=device, reason=lease.warning)
            if device is not None and lease.state is LeaseState.ACTIVE:
                try:
                    await self.ensure(lease)
                except MigdError as exc:
                    log.warning("mps.reattach_failed", lease_id=lease.lease_id, error=exc.message)

    # -- shares -----------------------------------------------------------------------------

    async def ensure(self, lease: Lease, cgroup: str | None = None) -> None:
        """Start the lease's share on its device; a share that cannot start ends the lease.

        ``cgroup``: the job's cgroup as the wrapper sent it (``/htcondor/…``); its limit is
        set after the share started (:meth:`limit_cgroup`), never failing the lease.
        """
        device = lease.mps_device_uuid
        if device is None or self.mps is None or lease.gpu is None:
            return
        try:
            share = self.mps.share_for(lease)
            await self.executor.on_gpu(lease.gpu, self.mps.ensure_share, device, share)
        except MigdError:
            self.leases.release(lease, "MPS daemon could not start", end=LeaseEndReason.MPS_FAILED)
            raise
        await self.limit_cgroup(lease, share, device, cgroup)

    async def limit_cgroup(
        self, lease: Lease, share: MpsShare, device: str, cgroup: str | None
    ) -> None:
        """MPS v3: set the share's memory (limit × clients, as the books count it) as the
        job cgroup's hard limit where :func:`cgroup_limit_decision` says so. Detection and
        the NVML calls run on the lease's GPU thread; any refusal is logged, noted for
        `migctl status` and leaves the lease as it is."""
        ctx, gpu_index = self.ctx, lease.gpu
        if gpu_index is None or lease.lease_id in ctx.cgroup_book.applied:
            return
        book, port = ctx.cgroup_book, ctx.cgroup_limits
        gpu = ctx.sched.gpus.get(gpu_index)
        cfg = ctx.config.mps
        mig = bool(lease.mig_uuid) or device.startswith("MIG-")
        kind = DeviceKind.MIG if mig else DeviceKind.GPU
        hard = share.accounted_mib
        device_mib = gpu.memory_total_mib if gpu is not None else 0
        for _ in range(2):  # at most one detection, then a decision
            decision = cgroup_limit_decision(
                setting=cfg.cgroup_limits,
                support=book.support.get(gpu_index),
                now_s=ctx.clock.monotonic(),
                cgroup=cgroup,
                kind=kind,
                hard_mib=hard,
                device_mib=device_mib,
            )
            if decision.action is not CgroupLimitAction.DETECT:
                break
            if port is None:
                reason: str | None = "this migd has no per-cgroup memory limit port"
            else:
                try:
                    reason = await self.executor.on_gpu(gpu_index, port.support, gpu_index)
                except MigdError as exc:
                    reason = f"detection failed: {exc.message}"
            book.support[gpu_index] = CgroupSupport(reason, ctx.clock.monotonic())
        if decision.action is not CgroupLimitAction.APPLY or port is None or cgroup is None:
            book.why_not[device] = decision.reason
            if cgroup is not None:
                log.info(
                    "mps.cgroup_limit_skipped", lease_id=lease.lease_id, reason=decision.reason
                )
            return
        path = str(cfg.cgroup_root / cgroup.lstrip("/"))
        try:
            await self.executor.on_gpu(gpu_index, port.set_limit, gpu_index, path, hard)
        except MigdError as exc:
            why = f"could not limit cgroup {path} to {hard} MiB: {exc.message}"
            note = (
                f"MPS device {device}: NVML refused a job cgroup limit ({exc.message}); "
                "its leases keep their pinned limit"
            )
            if note not in ctx.notes:  # once per device and cause, not per lease
                ctx.notes.append(note)
            book.why_not[device] = why
            log.warning(
                "mps.cgroup_limit_failed",
                lease_id=lease.lease_id,
                cgroup=path,
                hard_mib=hard,
                error=exc.message,
                hint="the job keeps its per-process pinned limit",
            )
            return
        applied = AppliedCgroupLimit(gpu_index, device, path, hard)
        if lease.state is not LeaseState.ACTIVE:  # released while the limit was being set
            self.executor.run_detached(gpu_index, clear_cgroup, port, applied)
            return
        book.applied[lease.lease_id] = applied
        self.leases.record("mps.cgroup_limit", lease, cgroup=path, hard_mib=hard)
        log.info("mps.cgroup_limit", lease_id=lease.lease_id, cgroup=path, hard_mib=hard)

    def _leases_on(self, device_uuid: str) -> list[Lease]:
        return [
            lease
            for lease in self.ctx.sched.active_leases()
            if lease.state is LeaseState.ACTIVE and lease.mps_device_uuid == device_uuid
        ]

    def clients_lost(self, device_uuid: str, why: str) -> None:
        """Flag the leases of an MPS device whose clients died; record it in the history."""
        now = self.ctx.clock.now()
        for lease in self._leases_on(device_uuid):
            lease.warn(f"MPS clients lost: {why}", now)
            self.leases.save(lease)
            self.leases.record("mps.clients_lost", lease, device=device_uuid, reason=why)
            log.warning(
                "mps.clients_lost",
                lease_id=lease.lease_id,
                job_id=lease.request.job_id,
                device=device_uuid,
                reason=why,
            )

    def _gpu_of_device(self, device_uuid: str) -> ManagedGpu | None:
        for gpu in self.ctx.sched.gpus.values():
            if gpu.uuid == device_uuid or any(i.uuid == device_uuid for i in gpu.instances):
                return gpu
        return None

    # -- housekeeping -----------------------------------------------------------------------

    def kick_housekeeping(self) -> None:
        """Start a housekeeping round unless one runs (a hung daemon must not stall reaping)."""
        if self.mps is None:
            return
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._housekeeping(self.mps), name="mps")

    async def _housekeeping(self, mps: MpsControl) -> None:
        """Restart dead MPS daemons/servers (their clients are lost), stop idle ones, and
        refresh the MPS status `migctl status` shows; all off the event loop."""
        loop = asyncio.get_running_loop()
        sched = self.ctx.sched
        try:
            self.apply_health(await loop.run_in_executor(None, mps.check_health))
            await loop.run_in_executor(None, mps.stop_idle)
            await loop.run_in_executor(None, mps.refresh_status)
            self.apply_client_caps(mps)
        except Exception as exc:
            log.exception("mps.housekeeping_crashed", error=str(exc))
        now, mono = self.ctx.now()
        # A GPU's health may have changed: place what fits now.
        self.leases.apply(sched.schedule(now, mono))

    def apply_health(self, report: MpsHealthReport) -> None:
        """Act on a health check (the housekeeping round's step): flag the leases whose
        clients were lost, mark the GPUs whose MPS device could not be brought back, and
        clear the mark of those that serve again (or are gone)."""
        for event in report.events:
            # (not event=: structlog's own first argument has that name)
            log.warning("mps.health", device=event.device_uuid, **event.to_dict())
        for uuid in report.affected_devices:
            detail = next(e.detail for e in report.events if e.device_uuid == uuid)
            self.clients_lost(uuid, f"the MPS server or daemon was restarted ({detail})")
        now = self.ctx.clock.now()
        sick = {u: g for u in report.failed_devices if (g := self._gpu_of_device(u))}
        for uuid, gpu in sick.items():
            gpu.health.raise_(HealthSource.MPS, f"{MPS_UNHEALTHY}: {uuid}", now)
        sick_gpus = {gpu.index for gpu in sick.values()}
        for gpu in self.ctx.sched.gpus.values():
            if gpu.index not in sick_gpus and gpu.health.clear(HealthSource.MPS):
                log.info("mps.recovered", gpu=gpu.index)

    def apply_client_caps(self, mps: MpsControl) -> None:
        """Lower each MPS device's client capacity in the books to the cap it showed (the
        clients connected when it refused one: ``clients_at_refusal``), so the next lease
        that would pass it waits or goes elsewhere instead of being refused by MPS."""
        for gpu in self.ctx.sched.gpus.values():
            pools = [i.mps_pool for i in gpu.instances if i.mps_pool is not None]
            if gpu.mps_pool is not None:
                pools.append(gpu.mps_pool)
            for pool in pools:
                seen = [
                    int(d["clients_at_refusal"])
                    for d in mps.cached_status_for(pool.device_uuid)
                    if d.get("clients_at_refusal")
                ]
                if seen and self.ctx.sched.observe_mps_client_cap(pool.device_uuid, max(seen)):
                    cap = min(pool.max_clients, max(seen))
                    self.ctx.notes.append(
                        f"MPS device {pool.device_uuid} refused a client with {max(seen)} "
                        f"connected: it now takes at most {cap} client processes"
                    )
                    log.warning("mps.client_cap_lowered", device=pool.device_uuid, max_clients=cap)

    def stop_before_destroy(self, gpu: int, mig_uuid: str | None) -> None:
        """In the GPU's thread, before a MIG instance is destroyed: stop its MPS daemon and
        wait (bounded, in the MPS manager) until its server has left the instance's NVML
        process list.

        Raises:
            GpuBusy: the instance's MPS server has clients (or cannot say), or is still on
                the instance after the wait: never destroy it then.
        """
        mps = self.mps
        if mps is None or not mig_uuid:
            return
        backend = self.ctx.backend
        mps.stop_for_teardown(mig_uuid, lambda: [p.pid for p in backend.processes(gpu, mig_uuid)])
        log.info("mps.stopped_for_destroy", gpu=gpu, device=mig_uuid)

    def usage(self, holder_pid: int, procs: list[GpuProcess]) -> list[GpuProcess]:
        """The GPU processes of an MPS lease: those in its holder's process tree.

        Every client of an MPS device shows on it, so the device's list has other jobs'
        processes too; the wrapper needs its own job's.
        """
        mine = []
        for proc in procs:
            pid, depth = proc.pid, 0
            while pid > 1 and depth < 64:
                if pid == holder_pid:
                    mine.append(proc)
                    break
                parent = self.ctx.procs.parent(pid)
                if parent is None:
                    break
                pid, depth = parent, depth + 1
        return mine

    async def client_error(self, lease: Lease, message: str) -> dict[str, Any]:
        """A wrapper saw an MPS failure in its job's stderr: pass it to the device's
        manager (the next health check restarts a device that refuses clients)."""
        device = lease.mps_device_uuid
        self.leases.record("wrapper.mps_client_error", lease, device=device, message=message)
        if device is None:
            # Not an MPS lease (a GPU in exclusive compute mode, say): history and log only.
            log.warning("client_error", lease_id=lease.lease_id, message=message)
            return {"recorded": True, "device": None}
        log.warning("mps.client_error", lease_id=lease.lease_id, device=device, message=message)
        if self.mps is not None:
            await asyncio.get_running_loop().run_in_executor(
                None, self.mps.report_client_error, device, message
            )
            self.kick_housekeeping()
        return {"recorded": True, "device": device}

    def shutdown(self) -> None:
        """Stop the daemons no active lease uses (those of active leases keep serving)."""
        if self.mps is None:
            return
        keep = {x.mps_device_uuid for x in self.ctx.sched.active_leases() if x.mps_device_uuid}
        with contextlib.suppress(Exception):
            self.mps.shutdown(keep=keep)
