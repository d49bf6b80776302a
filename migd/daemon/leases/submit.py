"""The daemon's main use case: a client asks for a lease and waits until it can use it.

:meth:`LeaseSubmitter.submit` takes the API's request as it came (the ``lease`` op's
handler only moves it between the socket and here): it settles who holds the lease and
how long it may wait, enters it (:meth:`LeaseService.enter`), waits for the grant,
checks that a reused instance has no late orphan on it (else asks again for what is
left of the wait), and starts its MPS share.

Apart from :class:`~migd.daemon.leases.service.LeaseService` because it needs the MPS
supervisor, which is built after (and with) the lease service.
"""

from __future__ import annotations

import asyncio
import dataclasses

import structlog

from migd.api import LeaseRequestMsg
from migd.core.groups import merge_environments
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.daemon.context import DaemonContext
from migd.daemon.leases.executor import GpuExecutor
from migd.daemon.leases.leftovers import LeftoverChecks
from migd.daemon.leases.service import LeaseService
from migd.daemon.supervision.mps import MpsSupervisor
from migd.errors import InvalidRequest, MigdError

log = structlog.get_logger("migd")


class LeaseSubmitter:
    """See the module docstring."""

    def __init__(
        self,
        ctx: DaemonContext,
        executor: GpuExecutor,
        leases: LeaseService,
        mps: MpsSupervisor,
        leftovers: LeftoverChecks,
    ) -> None:
        self.ctx = ctx
        self.executor = executor
        self.leases = leases
        self.mps = mps
        self.leftovers = leftovers

    def holder(self, req: LeaseRequestMsg, uid: int, pid: int) -> int:
        """The process that holds the lease: the caller as the kernel names it
        (SO_PEERCRED, translated into migd's PID namespace). A client may name another
        process of its own; a PID that is not one (e.g. the caller's getpid() inside a
        PID namespace, as older wrappers sent) is ignored rather than refused."""
        if req.holder_pid is None or req.holder_pid == pid:
            return pid
        if self.ctx.procs.uid(req.holder_pid) == uid:
            return req.holder_pid
        log.warning(
            "lease.holder_pid_ignored",
            holder_pid=req.holder_pid,
            uid=uid,
            using_pid=pid,
            reason="not a process of the caller's uid in migd's PID namespace",
        )
        return pid

    def request(self, req: LeaseRequestMsg) -> LeaseRequest:
        """The scheduler's request for the API's, its wait capped by ``policy.max_wait_s``."""
        policy = self.ctx.config.policy
        wait_s = policy.default_wait_s if req.wait_s is None else req.wait_s
        return LeaseRequest(
            job_id=req.job_id,
            memory_mib=req.memory_mib,
            slot=req.slot,
            min_compute=req.min_compute,
            profile=req.profile,
            mode=req.mode,
            gpu_uuids=tuple(req.gpus) if req.gpus else None,
            wait_s=min(wait_s, policy.max_wait_s),
            mps_clients=req.mps_clients,
            mps_thread_percentage=req.mps_thread_percentage,
        )

    async def submit(
        self, req: LeaseRequestMsg, uid: int, pid: int, reader: asyncio.StreamReader
    ) -> tuple[Lease, LeaseState]:
        """The active lease for ``req`` from the caller ``uid``/``pid``, and its first
        state (queued: it waited for capacity; preparing: NVML made its partition).
        ``reader`` is the client's connection: a hang-up withdraws the request."""
        ctx = self.ctx
        holder = self.holder(req, uid, pid)
        request = self.request(req)
        deadline = ctx.clock.monotonic() + (request.wait_s or 0.0)
        while True:
            lease = self.leases.enter(request, uid, holder)
            # Queued: no capacity now, the grant waits for other leases to end. Preparing:
            # the partition is being made for this request (NVML time, not queueing).
            first_state = lease.state
            if lease.state is not LeaseState.ACTIVE:
                lease = await self.leases.wait_active(lease, reader, request.wait_s or 0.0)
            if await self.leftovers.check_handout(lease):
                break
            # A late orphan holds the instance it got (now quarantined): ask again for
            # what is left of the wait. Each round quarantines one instance, so it ends.
            left = max(0.0, deadline - ctx.clock.monotonic())
            request = dataclasses.replace(request, wait_s=left)
        await self.mps.ensure(lease, cgroup=req.cgroup)
        return lease, first_state

    async def submit_group(
        self, req: LeaseRequestMsg, uid: int, pid: int, reader: asyncio.StreamReader
    ) -> tuple[list[Lease], dict[str, str], LeaseState]:
        """A job on ``req.gpu_count`` GPUs: one active lease per GPU, granted all or none
        (:meth:`migd.core.scheduler.NodeScheduler.submit_group`), the job's one
        environment listing every device (:func:`migd.core.groups.merge_environments`),
        and the first member's first state. Whatever ends the wait for one member (a
        refusal, the client gone, a failed partition, a late orphan) releases them all.
        """
        ctx = self.ctx
        count = req.gpu_count
        holder = self.holder(req, uid, pid)
        request = self.request(req)
        if request.mode == "mps":
            raise InvalidRequest(
                f"a job on {count} GPUs cannot run on MPS shares: one process reaches one "
                "MPS server (one CUDA_MPS_PIPE_DIRECTORY)",
                hint='ask for mode "mig" or "auto" (MigdMode, migd-run --mode)',
            )
        gpus = list(req.gpus or [])
        if len(gpus) == count:  # member i on the i-th GPU HTCondor assigned
            requests = [dataclasses.replace(request, gpu_uuids=(g,)) for g in gpus]
        else:  # any GPUs of these (or of the node), one each
            requests = [request] * count
        deadline = ctx.clock.monotonic() + (request.wait_s or 0.0)
        while True:
            members = self.leases.enter_group(requests, uid, holder)
            first_state = members[0].state
            try:
                for i, member in enumerate(members):
                    if member.state is not LeaseState.ACTIVE:
                        members[i] = await self.leases.wait_active(
                            member, reader, requests[0].wait_s or 0.0
                        )
            except MigdError:
                self._release_group(members, "another GPU of the job's group was not granted")
                raise
            handed = [await self.leftovers.check_handout(m) for m in members]
            if all(handed):
                break
            # A late orphan on one member's reused instance (that member is released and
            # its instance quarantined): the others go too, and the group asks again.
            self._release_group(members, "another GPU of the job's group was not clean")
            left = max(0.0, deadline - ctx.clock.monotonic())
            requests = [dataclasses.replace(r, wait_s=left) for r in requests]
        try:
            for member in members:
                await self.mps.ensure(member, cgroup=req.cgroup)
            env = merge_environments(members)
        except MigdError:
            self._release_group(members, "the job's GPUs could not be combined")
            raise
        return members, env, first_state

    def _release_group(self, members: list[Lease], reason: str) -> None:
        for member in members:
            self.leases.release(member, reason)
