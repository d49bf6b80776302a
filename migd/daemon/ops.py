"""The API's op handlers, and the table that declares who may call each op.

:func:`register_ops` puts every production op into the server's table with its
:class:`~migd.daemon.api_server.Access`; simulator-only ops are registered apart
(:mod:`migd.daemon.sim_ops`). Handlers get a :class:`~migd.daemon.api_server.Call`
whose authorisation is already checked.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from migd import __version__
from migd.api import (
    ExplainRequest,
    GpuRequest,
    HistoryRequest,
    LeaseRef,
    LeaseRequestMsg,
    ReleaseJobRequest,
    ReportRequest,
    StatusRequest,
)
from migd.core.leases import LeaseState
from migd.core.scheduler import GpuMode, Lease, LeaseRequest, ManagedGpu
from migd.daemon.api_server import Access, ApiServer, Call
from migd.daemon.auth import Peer
from migd.daemon.context import DaemonContext
from migd.daemon.executor import GpuExecutor
from migd.daemon.lease_service import LeaseService
from migd.daemon.mps_supervisor import MpsSupervisor
from migd.daemon.periodic import known_sum
from migd.daemon.status import build_status, explain_job
from migd.errors import InvalidRequest, LeaseNotFound, MigdError, NotAuthorized

_CLUSTER_PROC = re.compile(r"\d+\.\d+")
log = structlog.get_logger("migd")


class Ops:
    """The handlers (see the module docstring); ``reload`` is the daemon's."""

    def __init__(
        self,
        ctx: DaemonContext,
        leases: LeaseService,
        executor: GpuExecutor,
        mps: MpsSupervisor,
        reload: Callable[[], Awaitable[dict[str, Any]]],
    ) -> None:
        self.ctx = ctx
        self.leases = leases
        self.executor = executor
        self.mps = mps
        self.reload = reload

    def register(self, server: ApiServer) -> None:
        """The op table: each op, its handler, and who may call it."""
        reg = server.register
        reg("ping", self.ping, Access.ANYONE)
        reg("lease", self.lease, Access.LEASE)
        reg("get_lease", self.get_lease, Access.OWNER, "read")
        reg("heartbeat", self.heartbeat, Access.OWNER, "heartbeat")
        reg("usage", self.usage, Access.OWNER, "read")
        reg("release", self.release, Access.OWNER, "release")
        reg("release_job", self.release_job, Access.ANYONE)  # decides per lease, see there
        reg("report", self.report, Access.OWNER, "report on")
        reg("status", self.status, Access.READ)
        reg("leases", self.list_leases, Access.READ)
        reg("reload", self.reload_config, Access.ADMIN, "reload the configuration")
        reg("explain", self.explain, Access.READ)
        reg("history", self.history, Access.READ)
        for op in ("drain", "resume", "reset"):
            reg(op, self.gpu_op, Access.ADMIN, "{op} a GPU")

    # -- views ------------------------------------------------------------------------------

    def lease_view(self, lease: Lease, peer: Peer) -> dict[str, Any]:
        view = lease.to_dict()
        if peer.uid != lease.owner_uid and not self.ctx.auth.is_admin(peer):
            view.pop("env", None)  # another user's environment is not theirs to read
        return view

    def _job_id(self, given: str) -> str:
        """A job as admins name it: its GlobalJobId as the wrapper sends it, or the
        ``ClusterId.ProcId`` that ``condor_q`` shows when one schedd's job matches."""
        db = self.ctx.db
        if "#" in given or not _CLUSTER_PROC.fullmatch(given):
            return given
        if db.leases_for_job(given):  # leased by a client that sent the short form
            return given
        found = db.job_ids_ending(given)
        if len(found) > 1:
            raise InvalidRequest(
                f"job {given} names {len(found)} jobs from different access points: "
                + ", ".join(found[:5]),
                hint="give the GlobalJobId (condor_q -af GlobalJobId)",
            )
        return found[0] if found else given

    # -- ops anyone or readers may call -----------------------------------------------------

    async def ping(self, call: Call) -> dict[str, Any]:
        return {"version": __version__, "pid": os.getpid(), "backend": self.ctx.config.backend.kind}

    async def status(self, call: Call) -> dict[str, Any]:
        return build_status(self.ctx)

    async def list_leases(self, call: Call) -> dict[str, Any]:
        req: StatusRequest = call.request
        sched, db = self.ctx.sched, self.ctx.db
        leases = sched.active_leases() if not req.all else db.recent_leases(500)
        return {"leases": [self.lease_view(lease, call.peer) for lease in leases]}

    async def explain(self, call: Call) -> dict[str, Any]:
        req: ExplainRequest = call.request
        job_id = self._job_id(req.job_id)
        return explain_job(self.ctx, job_id, lambda lease: self.lease_view(lease, call.peer))

    async def history(self, call: Call) -> dict[str, Any]:
        req: HistoryRequest = call.request
        job = self._job_id(req.job_id) if req.job_id else None
        rows = self.ctx.db.history(limit=req.limit, job_id=job)
        return {"history": [r.to_dict() for r in rows]}

    async def reload_config(self, call: Call) -> dict[str, Any]:
        return await self.reload()

    # -- leases -----------------------------------------------------------------------------

    async def lease(self, call: Call) -> dict[str, Any]:
        req: LeaseRequestMsg = call.request
        ctx, peer = self.ctx, call.peer
        # The holder is the caller as the kernel names it (SO_PEERCRED, translated into
        # migd's PID namespace). A client may name another process of its own; a PID
        # that is not one (e.g. the caller's getpid() inside a PID namespace, as older
        # wrappers sent) is ignored rather than refused.
        holder = peer.pid
        if req.holder_pid is not None and req.holder_pid != peer.pid:
            if ctx.procs.uid(req.holder_pid) == peer.uid:
                holder = req.holder_pid
            else:
                log.warning(
                    "lease.holder_pid_ignored",
                    holder_pid=req.holder_pid,
                    uid=peer.uid,
                    using_pid=peer.pid,
                    reason="not a process of the caller's uid in migd's PID namespace",
                )
        policy = ctx.config.policy
        wait_s = policy.default_wait_s if req.wait_s is None else req.wait_s
        wait_s = min(wait_s, policy.max_wait_s)
        request = LeaseRequest(
            job_id=req.job_id,
            memory_mib=req.gpu_memory_mib,
            slot=req.slot,
            min_compute=req.min_compute,
            profile=req.profile,
            mode=req.mode,
            gpu_uuids=tuple(req.gpus) if req.gpus else None,
            wait_s=wait_s,
            mps_clients=req.mps_clients,
            mps_thread_percentage=req.mps_thread_percentage,
        )
        now, mono = ctx.now()
        lease = Lease(
            lease_id=f"{int(now)}-{secrets.token_hex(4)}",
            request=request,
            owner_uid=peer.uid,
            owner_pid=holder,
            owner_start_s=ctx.procs.start_time(holder),
            created_s=now,
        )
        try:
            outcome = ctx.sched.submit(lease, now, mono)
        except MigdError as refusal:  # never fits, bad profile, ...: counted, then raised
            self.leases.refused(refusal)
            raise
        if outcome.refusal is not None:
            self.leases.refused(outcome.refusal)
            # Refused, but the same pass may have placed requests queued before it.
            self.leases.apply(outcome)
            raise outcome.refusal
        self.leases.record(
            "submitted",
            lease,
            memory_mib=request.memory_mib,
            mode=request.mode,
            uid=peer.uid,
            state=lease.state.value,
            queued_position=outcome.queued_position,
        )
        self.leases.apply(outcome)
        # Queued: no capacity now, the grant waits for other leases to end. Preparing: the
        # partition is being made for this request (NVML time, not queueing).
        first_state = lease.state
        if lease.state is not LeaseState.ACTIVE:
            lease = await self.leases.wait_active(lease, call.reader, wait_s)
        await self.mps.ensure(lease)
        view = self.lease_view(lease, peer)
        view["queued"] = first_state is LeaseState.QUEUED
        view["prepared"] = first_state is LeaseState.PREPARING
        return view

    async def get_lease(self, call: Call) -> dict[str, Any]:
        return self.lease_view(call.owned, call.peer)

    async def heartbeat(self, call: Call) -> dict[str, Any]:
        lease = call.owned
        if lease.state is not LeaseState.ACTIVE:
            raise LeaseNotFound(f"lease {lease.lease_id} is {lease.state.value}, not active")
        self.ctx.sched.heartbeat(lease.lease_id, self.ctx.clock.now())
        self.leases.save(lease)
        return {"state": lease.state.value}

    async def release(self, call: Call) -> dict[str, Any]:
        req: LeaseRef = call.request
        return self.leases.release(call.owned, req.reason or f"released by uid {call.peer.uid}")

    async def release_job(self, call: Call) -> dict[str, Any]:
        """The JOB_EXIT hook's release: admins and ``api.hook_users`` release every lease of
        the job, anyone else only their own (a job id alone proves nothing: any user can
        name any job)."""
        req: ReleaseJobRequest = call.request
        peer = call.peer
        # Job ids are GlobalJobIds (unique across access points); a caller that knows the
        # slot narrows it further, so a bare ClusterId.ProcId cannot hit another schedd's job.
        leases = [
            lease
            for lease in self.ctx.sched.active_leases()
            if lease.request.job_id == req.job_id
            and not (req.slot and lease.request.slot and lease.request.slot != req.slot)
        ]
        if not self.ctx.auth.may_release_any(peer):
            mine = [lease for lease in leases if lease.owner_uid == peer.uid]
            if leases and not mine:
                raise NotAuthorized(
                    f"user {peer.user} (uid {peer.uid}) may not release job {req.job_id}'s "
                    f"leases: they belong to uid {leases[0].owner_uid}",
                    hint="the lease's owner, an admin or a user in api.hook_users may",
                    uid=peer.uid,
                )
            leases = mine
        released = []
        for lease in leases:
            reason = req.reason or f"released by the JOB_EXIT hook (uid {peer.uid})"
            self.leases.release(lease, reason)
            released.append(lease.lease_id)
        return {"released": released}

    async def usage(self, call: Call) -> dict[str, Any]:
        lease = call.owned
        if lease.gpu is None or lease.state is not LeaseState.ACTIVE:
            return {"state": lease.state.value}
        gpu, on_gpu, backend = lease.gpu, self.executor.on_gpu, self.ctx.backend
        # MIG: the instance; MPS: its device (a MIG instance or the whole GPU).
        device = lease.mig_uuid if lease.mode in ("mig", "mps") else None
        try:
            memory = await on_gpu(gpu, backend.memory, gpu, device, timeout_s=10.0)
            procs = await on_gpu(gpu, backend.processes, gpu, device, timeout_s=10.0)
            if lease.mode == "mps":  # the device is shared: only this job's processes
                procs = await on_gpu(gpu, self.mps.usage, lease, procs, timeout_s=10.0)
        except (MigdError, TimeoutError) as exc:
            return {"state": lease.state.value, "error": str(exc)}
        self.leases.note_peak(
            lease.lease_id, known_sum(procs) if lease.mode == "mps" else memory.used_mib
        )
        return {
            "state": lease.state.value,
            "limit_mib": lease.memory_limit_mib,
            "peak_used_mib": self.leases.peaks.get(lease.lease_id),
            "device_used_mib": memory.used_mib,
            "device_total_mib": memory.total_mib,
            "processes": [{"pid": p.pid, "used_mib": p.used_mib} for p in procs],
            "scope": "job" if lease.mode == "mps" else "device",
        }

    async def report(self, call: Call) -> dict[str, Any]:
        req: ReportRequest = call.request
        lease = call.owned
        if req.event == "mps_client_error":
            message = str(req.data.get("message", "")).strip()[:4096]
            if not message:
                raise InvalidRequest(
                    "an mps_client_error report needs data.message",
                    hint='send {"message": "<the stderr line>"}',
                )
            return await self.mps.client_error(lease, message)
        self.leases.record(f"wrapper.{req.event}", lease, **req.data)
        # Nested, so a client's keys can neither clash with nor forge the log's own
        # fields (level, timestamp, event, lease_id).
        log.info(
            f"wrapper.{req.event}",
            lease_id=lease.lease_id,
            job_id=lease.request.job_id,
            data=req.data,
        )
        return {"recorded": True}

    # -- GPUs -------------------------------------------------------------------------------

    async def gpu_op(self, call: Call) -> dict[str, Any]:
        req: GpuRequest = call.request
        peer, ctx = call.peer, self.ctx
        sched = ctx.sched
        gpu = self._gpu_ref(req.gpu)
        now, mono = ctx.now()
        if req.op in ("drain", "resume"):
            outcome = sched.set_draining(gpu.index, req.op == "drain", now, mono)
            draining = sorted(g.uuid for g in sched.gpus.values() if g.draining)
            ctx.db.set_meta("draining", draining)
            self.leases.record(req.op, None, gpu=gpu.index, uid=peer.uid)
            log.info(f"gpu.{req.op}", gpu=gpu.index, uid=peer.uid)
            self.leases.apply(outcome)
            return {"gpu": gpu.index, "draining": gpu.draining}
        if gpu.mode is not GpuMode.MIG:
            raise InvalidRequest(f"GPU {gpu.index} is not in MIG mode; nothing to reset")
        busy = [str(i) for i in gpu.instances if i.busy]
        outcome = sched.reset(gpu.index)
        self.leases.record("reset", None, gpu=gpu.index, uid=peer.uid, kept=busy)
        self.leases.apply(outcome)
        return {
            "gpu": gpu.index,
            "destroying": [str(op) for w in outcome.work for op in w.ops],
            "kept_busy": busy,
        }

    def _gpu_ref(self, ref: str) -> ManagedGpu:
        for gpu in self.ctx.sched.gpus.values():
            if ref == str(gpu.index) or (len(ref) >= 8 and gpu.uuid.startswith(ref)):
                return gpu
        raise InvalidRequest(
            f"no GPU {ref!r} on this node", hint="use an index or UUID from `migctl status`"
        )
