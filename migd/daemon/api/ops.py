"""The API's op handlers, and the table that declares who may call each op.

:func:`register_ops` puts every production op into the server's table with its
:class:`~migd.daemon.api.server.Access`; simulator-only ops are registered apart
(:mod:`migd.daemon.api.sim_ops`). Handlers get a :class:`~migd.daemon.api.server.Call`
whose authorisation is already checked.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar, cast

import structlog

from migd import __version__
from migd.api import (
    ExplainRequest,
    GpuRequest,
    GroupLeaseReply,
    HistoryRequest,
    LeaseRef,
    LeaseReply,
    LeaseRequestMsg,
    ReleaseJobRequest,
    ReloadRequest,
    ReportRequest,
    StatusReply,
    StatusRequest,
)
from migd.core.gpus import GpuMode, ManagedGpu
from migd.core.lease_end import LeaseEnded, LeaseEndReason
from migd.core.leases import Lease, LeaseState, LeaseView
from migd.daemon.api.auth import Peer
from migd.daemon.api.server import Access, ApiServer, Call
from migd.daemon.api.status import build_status, explain_job
from migd.daemon.context import DaemonContext
from migd.daemon.leases.executor import GpuExecutor
from migd.daemon.leases.leftovers import LeftoverChecks
from migd.daemon.leases.service import LeaseService
from migd.daemon.leases.submit import LeaseSubmitter
from migd.daemon.supervision.mps import MpsSupervisor, known_sum
from migd.errors import InvalidRequest, LeaseNotFound, MigdError, NotAuthorized

#: A reply as handed to :meth:`Ops._for_peer`, and its scrubbed copy.
R = TypeVar("R", bound=Mapping[str, Any])
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
        submitter: LeaseSubmitter,
        leftovers: LeftoverChecks,
        reload: Callable[..., Awaitable[dict[str, Any]]],
    ) -> None:
        self.ctx = ctx
        self.leases = leases
        self.executor = executor
        self.mps = mps
        self.submitter = submitter
        self.leftovers = leftovers
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

    def lease_view(self, lease: Lease, peer: Peer) -> LeaseView:
        view = lease.to_dict()
        if peer.uid != lease.owner_uid and not self.ctx.auth.is_admin(peer):
            view.pop("env", None)  # another user's environment is not theirs to read
        return view

    def _hidden_from(self, peer: Peer) -> frozenset[str]:
        """The MIG device UUIDs ``peer`` may not see: those of live leases of other users.

        A MIG UUID is the ``CUDA_VISIBLE_DEVICES`` value of the job that holds it, so a
        reply must not pair another user's lease with it (docs/api.md, "What another
        user sees"). Everything else of the lease stays visible (id, job, state, GPU,
        profile, placement), and so do idle instances' UUIDs and GPU UUIDs.
        """
        if self.ctx.auth.is_admin(peer):
            return frozenset()
        gpu_uuids = {g.uuid for g in self.ctx.sched.gpus.values()}
        return frozenset(
            lease.mig_uuid
            for lease in self.ctx.sched.leases.values()
            if lease.owner_uid != peer.uid
            and lease.mig_uuid
            and lease.mig_uuid not in gpu_uuids
            and not lease.state.terminal
        )

    def _for_peer(self, reply: R, peer: Peer) -> R:
        """``reply`` with every UUID ``peer`` may not see replaced by None (in strings that
        merely contain one, by "<hidden>"): a copy of the same shape."""
        hidden = self._hidden_from(peer)
        if not hidden:
            return reply
        return cast(R, _scrub(reply, hidden))

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

    async def ping(self, call: Call[Any]) -> dict[str, Any]:
        return {"version": __version__, "pid": os.getpid(), "backend": self.ctx.config.backend.kind}

    async def status(self, call: Call[Any]) -> StatusReply:
        return self._for_peer(build_status(self.ctx), call.peer)

    async def list_leases(self, call: Call[StatusRequest]) -> dict[str, Any]:
        req = call.request
        sched, db = self.ctx.sched, self.ctx.db
        leases = sched.active_leases() if not req.all else db.recent_leases(500)
        reply = {"leases": [self.lease_view(lease, call.peer) for lease in leases]}
        return self._for_peer(reply, call.peer)

    async def explain(self, call: Call[ExplainRequest]) -> dict[str, Any]:
        req = call.request
        job_id = self._job_id(req.job_id)
        reply = explain_job(self.ctx, job_id, lambda lease: self.lease_view(lease, call.peer))
        return self._for_peer(reply, call.peer)

    async def history(self, call: Call[HistoryRequest]) -> dict[str, Any]:
        """A page of the history, newest first: at most ``limit`` rows and
        ``api.max_reply_bytes`` of event data; ``next_before_id`` asks for the next."""
        req = call.request
        db = self.ctx.db
        job = self._job_id(req.job_id) if req.job_id else None
        rows = db.history(
            limit=req.limit,
            job_id=job,
            before_id=req.before_id,
            max_bytes=self.ctx.config.api.max_reply_bytes,
        )
        more = bool(rows) and bool(db.history(limit=1, job_id=job, before_id=rows[-1].id))
        reply = {
            "history": [r.to_dict() for r in rows],
            "next_before_id": rows[-1].id if more else None,
        }
        return self._for_peer(reply, call.peer)

    async def reload_config(self, call: Call[ReloadRequest]) -> dict[str, Any]:
        return await self.reload(allow_removals=call.request.allow_removals)

    # -- leases -----------------------------------------------------------------------------

    async def lease(self, call: Call[LeaseRequestMsg]) -> LeaseReply | GroupLeaseReply:
        peer = call.peer
        if call.request.gpu_count > 1:
            members, env, first_state = await self.submitter.submit_group(
                call.request, peer.uid, peer.pid, call.reader
            )
            reply: GroupLeaseReply = {
                **self.lease_view(members[0], peer),
                "queued": first_state is LeaseState.QUEUED,
                "prepared": first_state is LeaseState.PREPARING,
                "group": [self.lease_view(m, peer) for m in members],
            }
            if "env" in reply:  # shown to the owner and admins only, as for one lease
                reply["env"] = env
            return reply
        lease, first_state = await self.submitter.submit(
            call.request, peer.uid, peer.pid, call.reader
        )
        return {
            **self.lease_view(lease, peer),
            "queued": first_state is LeaseState.QUEUED,
            "prepared": first_state is LeaseState.PREPARING,
        }

    async def get_lease(self, call: Call[LeaseRef]) -> LeaseView:
        return self.lease_view(call.owned, call.peer)

    async def heartbeat(self, call: Call[LeaseRef]) -> dict[str, Any]:
        lease = call.owned
        if lease.state is not LeaseState.ACTIVE:
            raise LeaseNotFound(f"lease {lease.lease_id} is {lease.state.value}, not active")
        now, mono = self.ctx.now()
        self.ctx.sched.heartbeat(lease.lease_id, now, mono)
        self.leases.save(lease)
        return {"state": lease.state.value}

    async def release(self, call: Call[LeaseRef]) -> LeaseEnded:
        req = call.request
        lease = call.owned
        # Its instance is checked for processes the job left before anyone gets it again
        # (LeftoverChecks): the release makes no NVML call.
        self.leftovers.released(lease)
        # Only its holder's release is the job's own; anyone else's (migctl release, an
        # admin) takes the partition from under a job that may still run: it must stop.
        end = None  # a request not granted yet is cancelled, whoever withdraws it
        if lease.state is LeaseState.ACTIVE:
            holder = call.peer.pid == lease.owner_pid
            end = LeaseEndReason.RELEASED if holder else LeaseEndReason.ADMIN_RELEASE
        return self.leases.release(lease, req.reason or f"released by uid {call.peer.uid}", end=end)

    async def release_job(self, call: Call[ReleaseJobRequest]) -> dict[str, Any]:
        """The JOB_EXIT hook's release: admins and ``api.hook_users`` release every lease of
        the job, anyone else only their own (a job id alone proves nothing: any user can
        name any job)."""
        req = call.request
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
                    f"user {self.ctx.auth.user_name(peer)} (uid {peer.uid}) may not release job "
                    f"{req.job_id}'s leases: they belong to uid {leases[0].owner_uid}",
                    hint="the lease's owner, an admin or a user in api.hook_users may",
                    uid=peer.uid,
                )
            leases = mine
        released = []
        for lease in leases:
            reason = req.reason or f"released by the JOB_EXIT hook (uid {peer.uid})"
            self.leftovers.released(lease)
            self.leases.release(lease, reason, end=LeaseEndReason.JOB_EXIT)
            released.append(lease.lease_id)
        return {"released": released}

    async def usage(self, call: Call[LeaseRef]) -> dict[str, Any]:
        lease = call.owned
        if lease.gpu is None or lease.state is not LeaseState.ACTIVE:
            return {"state": lease.state.value}
        gpu, on_gpu, backend = lease.gpu, self.executor.on_gpu, self.ctx.backend
        # MIG: the instance; MPS: its device (a MIG instance or the whole GPU).
        device = lease.mig_uuid if lease.mode in (GpuMode.MIG, GpuMode.MPS) else None
        try:
            memory = await on_gpu(gpu, backend.memory, gpu, device, timeout_s=10.0)
            procs = await on_gpu(gpu, backend.processes, gpu, device, timeout_s=10.0)
            if lease.mode is GpuMode.MPS:  # the device is shared: only this job's processes
                procs = await on_gpu(gpu, self.mps.usage, lease.owner_pid, procs, timeout_s=10.0)
        except (MigdError, TimeoutError) as exc:
            return {"state": lease.state.value, "error": str(exc)}
        self.leases.note_peak(
            lease.lease_id, known_sum(procs) if lease.mode is GpuMode.MPS else memory.used_mib
        )
        return {
            "state": lease.state.value,
            "limit_mib": lease.memory_limit_mib,
            "peak_used_mib": self.leases.peaks.get(lease.lease_id),
            "device_used_mib": memory.used_mib,
            "device_total_mib": memory.total_mib,
            "processes": [{"pid": p.pid, "used_mib": p.used_mib} for p in procs],
            "scope": "job" if lease.mode is GpuMode.MPS else "device",
        }

    async def report(self, call: Call[ReportRequest]) -> dict[str, Any]:
        req = call.request
        lease = call.owned
        if req.event == "mps_client_error":
            message = str(req.data.get("message", "")).strip()[:4096]
            if not message:
                raise InvalidRequest(
                    "an mps_client_error report needs data.message",
                    hint='send {"message": "<the stderr line>"}',
                )
            return await self.mps.client_error(lease, message)
        # What one lease's owner can make migd store is bounded: each report's size and
        # their number (1,500 reports of 60 KB grew the database by 191 MB in a second).
        api = self.ctx.config.api
        size = len(json.dumps(req.data, separators=(",", ":")))
        if size > api.max_report_bytes:
            raise InvalidRequest(
                f"report data is {size} bytes of JSON; at most {api.max_report_bytes} "
                "(api.max_report_bytes)",
                hint="send a summary; keep large output in the job's own files",
            )
        recorded = self.ctx.db.count_events(lease.lease_id, "wrapper.")
        if recorded >= api.max_reports_per_lease:
            raise InvalidRequest(
                f"lease {lease.lease_id} has recorded {recorded} reports already "
                f"(api.max_reports_per_lease = {api.max_reports_per_lease})",
                hint="report only what changes the lease's story (OOM, exit, forecasts)",
            )
        self.ctx.db.require_writable()  # a report the history cannot keep is refused
        peak = req.data.get("peak_used_mib")
        if isinstance(peak, int) and not isinstance(peak, bool) and 0 <= peak <= 100_000_000:
            # The wrapper's (or the job's own) peak joins migd's samples, so the peak the
            # release records is never below what the job is known to have used.
            self.leases.note_peak(lease.lease_id, peak)
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

    async def gpu_op(self, call: Call[GpuRequest]) -> dict[str, Any]:
        req = call.request
        peer, ctx = call.peer, self.ctx
        sched = ctx.sched
        gpu = self._gpu_ref(req.gpu)
        ctx.db.require_writable()  # a drain flag that cannot be kept would not survive
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


def _scrub(value: Any, hidden: frozenset[str]) -> Any:
    """A copy of a JSON-like ``value`` with the ``hidden`` strings taken out."""
    if isinstance(value, str):
        if value in hidden:
            return None
        if "MIG-" in value:
            for secret in hidden:
                value = value.replace(secret, "<hidden>")
        return value
    if isinstance(value, dict):
        return {k: _scrub(v, hidden) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(v, hidden) for v in value]
    return value
