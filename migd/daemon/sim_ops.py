"""Simulator-only API ops: fake CUDA processes on the simulated node.

``sim_attach``, ``sim_alloc``, ``sim_free`` and ``sim_detach`` let a fake job (see
``migd.testing.simjob``) behave like a CUDA program on the simulated GPUs. They are
registered with the API server only when migd runs the simulated backend; otherwise the
server answers that they exist only there. Nothing in the production ops depends on
this module.
"""

from __future__ import annotations

from typing import Any

from migd.api import SimRequest
from migd.backends.simulated.node import SimCudaError, SimNode, SimOutOfMemory
from migd.daemon.api_server import Access, ApiServer, Call
from migd.errors import InvalidRequest

SIM_OPS = ("sim_attach", "sim_alloc", "sim_free", "sim_detach")


class SimOps:
    def __init__(self, node: SimNode) -> None:
        self.node = node

    def register(self, server: ApiServer) -> None:
        for op in SIM_OPS:
            server.register(op, self.handle, Access.LEASE)

    async def handle(self, call: Call) -> dict[str, Any]:
        req: SimRequest = call.request
        node = self.node
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
