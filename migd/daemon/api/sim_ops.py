"""Simulator-only API ops: fake CUDA processes and XIDs on the simulated node.

``sim_attach``, ``sim_alloc``, ``sim_free`` and ``sim_detach`` let a fake job (see
``migd.backends.simulated.cuda_job``) behave like a CUDA program on the simulated GPUs;
``sim_xid`` (admins only) injects an NVML event (tests, demos). ``main()`` registers them
with the API server only when migd runs the simulated backend; otherwise the server
answers that they exist only there. Nothing in the production ops depends on this module.

They check ownership like every other lease operation: a fake CUDA process may attach
only to a device of one of its user's live leases, and only the process's user (or an
admin) may allocate, free or detach for it.
"""

from __future__ import annotations

from typing import Any

from migd.api import SimRequest, SimXidRequest
from migd.backends.simulated.node import SimCudaError, SimNode, SimOutOfMemory
from migd.backends.simulated.nvml_events import events_for
from migd.daemon.api.auth import Peer
from migd.daemon.api.server import Access, ApiServer, Call
from migd.daemon.context import DaemonContext
from migd.errors import InvalidRequest, NotAuthorized

SIM_OPS = ("sim_attach", "sim_alloc", "sim_free", "sim_detach")


class SimOps:
    def __init__(self, node: SimNode, ctx: DaemonContext) -> None:
        self.node = node
        self.ctx = ctx

    def _check(self, req: SimRequest, peer: Peer) -> None:
        """The caller owns the process, and (attach) a live lease on the device."""
        if self.ctx.auth.is_admin(peer):
            return
        owner = self.ctx.procs.uid(req.pid)
        if owner is None:
            # No host process: either one that is gone (judged by the device it used) or,
            # to attach, a process that lives only in the simulation (a job's escaped child
            # in tests), judged below by the caller's lease on the device it attaches to.
            proc = self.node.process(req.pid)
            device = proc.device_uuid if proc is not None else None
            new_fake = proc is None and req.op == "sim_attach"
            if not new_fake and (device is None or not self._leases_device(peer, device)):
                raise NotAuthorized(
                    f"process {req.pid} is not one of uid {peer.uid}'s",
                    hint="a fake CUDA job acts only for its own processes",
                    uid=peer.uid,
                )
        elif owner != peer.uid:
            raise NotAuthorized(
                f"user {self.ctx.auth.user_name(peer)} (uid {peer.uid}) may not {req.op} for "
                f"process {req.pid} of uid {owner}",
                hint="a fake CUDA job acts only for its own processes",
                uid=peer.uid,
            )
        device = req.device_uuid
        if req.op == "sim_attach" and device is not None and not self._leases_device(peer, device):
            raise NotAuthorized(
                f"uid {peer.uid} holds no lease on {device}",
                hint="attach to the device of your own lease (its mig_uuid or GPU)",
                uid=peer.uid,
            )

    def _leases_device(self, peer: Peer, device: str) -> bool:
        return any(
            lease.owner_uid == peer.uid
            and not lease.state.terminal
            and device in (lease.mig_uuid, lease.gpu_uuid, lease.mps_device_uuid)
            for lease in self.ctx.sched.leases.values()
        )

    def register(self, server: ApiServer) -> None:
        for op in SIM_OPS:
            server.register(op, self.handle, Access.LEASE)
        server.register("sim_xid", self.sim_xid, Access.ADMIN, "inject XID events")

    async def sim_xid(self, call: Call[SimXidRequest]) -> dict[str, Any]:
        """Inject an XID on the simulated node; the health monitor's listener sees it."""
        req = call.request
        try:
            delivered = events_for(self.node).inject_xid(
                req.gpu, req.xid, gi_id=req.gi_id, ci_id=req.ci_id
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        return {"gpu": req.gpu, "xid": req.xid, "delivered": delivered}

    async def handle(self, call: Call[SimRequest]) -> dict[str, Any]:
        req = call.request
        node = self.node
        self._check(req, call.peer)
        try:
            if req.op == "sim_attach":
                if req.device_uuid is None:
                    raise ValueError("sim_attach needs device_uuid (the MIG or GPU UUID)")
                node.attach(req.pid, req.device_uuid, mps_pinned_limit_mib=req.mps_limit_mib)
            elif req.op == "sim_alloc":
                node.alloc(req.pid, req.mib)
            elif req.op == "sim_free":
                node.free(req.pid, req.mib)
            else:
                node.detach(req.pid)
        except SimCudaError as exc:
            # What a CUDA program would get back: a result for the fake job to print and
            # exit on, not a daemon error.
            oom = exc if isinstance(exc, SimOutOfMemory) else None
            return {
                "pid": req.pid,
                "cuda_error": str(exc),
                "oom": oom is not None,
                "limit_mib": oom.limit_mib if oom else None,
                "used_mib": oom.used_mib if oom else None,
            }
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        proc = node.process(req.pid)
        return {"pid": req.pid, "used_mib": proc.used_mib if proc else 0}
