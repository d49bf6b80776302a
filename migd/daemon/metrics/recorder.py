"""migd's event metrics: counters and histograms fed as things happen (lease transitions,
refusals, wrapper restarts, NVML create/destroy calls, XID events), and the backend wrapper
that times NVML's MIG calls. The overview is :mod:`migd.daemon.metrics.service`'s docstring.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from migd.core.leases import Lease, LeaseState
from migd.errors import MigdError
from migd.ports import GpuBackend, GpuInfo, GpuProcess, MemoryInfo, MigInstance

#: NVML create/destroy take 0.1 s to several seconds ([Villarrubia] Table 1; driver-dependent).
NVML_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
#: Queueing: from an immediate grant to policy.max_wait_s (a day by default).
WAIT_BUCKETS = (0.0, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)
#: Wrapper reports that mean the job was restarted in a bigger partition.
RESTART_EVENTS = {"oom": "oom", "forecast": "early"}


class MetricsRecorder:
    """Counters and histograms fed by the daemon as things happen.

    One per daemon, each with its own registry (never prometheus_client's global one), so
    two daemons in one test process never share a number.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.granted = Counter(
            "migd_leases_granted",
            "Leases that became active, by what they got (mig, mps, exclusive)",
            ["mode"],
            registry=r,
        )
        self.ended = Counter(
            "migd_leases_ended",
            "Leases that ended, by final state (released, reclaimed, expired, cancelled, failed)",
            ["state"],
            registry=r,
        )
        self.refused = Counter(
            "migd_leases_refused",
            "Lease requests refused at once, by error code (no_capacity, ...)",
            ["reason"],
            registry=r,
        )
        self.wait = Histogram(
            "migd_lease_wait_seconds",
            "Time from a lease request to its grant (queueing plus partition creation)",
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.restarts = Counter(
            "migd_job_restarts",
            "Jobs the wrapper restarted in a bigger partition: kind=oom after an "
            "out-of-memory failure, kind=early on the memory forecast",
            ["kind"],
            registry=r,
        )
        self.nvml_ops = Counter(
            "migd_nvml_operations",
            "NVML MIG create/destroy calls, by operation and result (ok or migd's error code)",
            ["op", "result"],
            registry=r,
        )
        self.nvml_seconds = Histogram(
            "migd_nvml_operation_seconds",
            "Duration of NVML MIG create/destroy calls",
            ["op"],
            buckets=NVML_BUCKETS,
            registry=r,
        )
        self.xid_events = Counter(
            "migd_gpu_xid_events",
            "NVML XID events seen, by GPU, XID and whether migd treats it as critical",
            ["gpu", "xid", "critical"],
            registry=r,
        )
        # Each lease's series, looked up once: labels() validates and joins its label
        # values under a lock on every call, twice per lease cycle (issue 26 §4).
        self._granted: dict[str, Any] = {}
        self._ended: dict[LeaseState, Any] = {}
        # Pre-create the common series so a rate() over them starts at 0, not absent.
        for mode in ("mig", "mps", "exclusive"):
            self.granted.labels(mode=mode)
        for state in LeaseState:
            if state.terminal:
                self.ended.labels(state=state.value)
        for kind in RESTART_EVENTS.values():
            self.restarts.labels(kind=kind)
        for op in ("create", "destroy"):
            self.nvml_ops.labels(op=op, result="ok")
            self.nvml_seconds.labels(op=op)

    def lease_changed(self, lease: Lease, new: LeaseState, now_s: float) -> None:
        """A lease reached state ``new`` (call once per transition)."""
        if new is LeaseState.ACTIVE:
            mode = lease.mode or "unknown"
            granted = self._granted.get(mode)
            if granted is None:
                granted = self._granted[mode] = self.granted.labels(mode=mode)
            granted.inc()
            self.wait.observe(max(0.0, now_s - lease.created_s))
        elif new.terminal:
            ended = self._ended.get(new)
            if ended is None:
                ended = self._ended[new] = self.ended.labels(state=new.value)
            ended.inc()

    def lease_refused(self, error: MigdError) -> None:
        self.refused.labels(reason=error.code).inc()

    def wrapper_report(self, event: str) -> None:
        """A wrapper's ``report`` op; only restarts are counted."""
        kind = RESTART_EVENTS.get(event)
        if kind is not None:
            self.restarts.labels(kind=kind).inc()

    def nvml_op(self, op: str, seconds: float, error: BaseException | None) -> None:
        result = "ok"
        if error is not None:
            result = error.code if isinstance(error, MigdError) else "error"
        self.nvml_ops.labels(op=op, result=result).inc()
        self.nvml_seconds.labels(op=op).observe(seconds)

    def xid(self, gpu: int, xid: int, critical: bool) -> None:
        self.xid_events.labels(gpu=str(gpu), xid=str(xid), critical=str(critical).lower()).inc()


class InstrumentedBackend:
    """A :class:`GpuBackend` that times MIG create/destroy calls into a recorder.

    Wrapping the backend (rather than timing inside the daemon) counts every NVML call,
    whichever part of the daemon makes it, including reconciliation's teardowns.
    """

    def __init__(self, backend: GpuBackend, recorder: MetricsRecorder) -> None:
        self.inner = backend
        self.recorder = recorder

    def _timed(self, op: str, fn: Callable[[], Any]) -> Any:
        started = time.monotonic()
        try:
            result = fn()
        except BaseException as exc:
            self.recorder.nvml_op(op, time.monotonic() - started, exc)
            raise
        self.recorder.nvml_op(op, time.monotonic() - started, None)
        return result

    def discover(self) -> list[GpuInfo]:
        return self.inner.discover()

    def geometry(self, gpu: int) -> Any:
        return self.inner.geometry(gpu)

    def list_instances(self, gpu: int) -> list[MigInstance]:
        return self.inner.list_instances(gpu)

    def create_instance(self, gpu: int, profile_id: int, start: int) -> MigInstance:
        inst: MigInstance = self._timed(
            "create", lambda: self.inner.create_instance(gpu, profile_id, start)
        )
        return inst

    def destroy_instance(self, gpu: int, gi_id: int) -> None:
        self._timed("destroy", lambda: self.inner.destroy_instance(gpu, gi_id))

    def memory(self, gpu: int, mig_uuid: str | None = None) -> MemoryInfo:
        return self.inner.memory(gpu, mig_uuid)

    def processes(self, gpu: int, mig_uuid: str | None = None) -> list[GpuProcess]:
        return self.inner.processes(gpu, mig_uuid)

    def heartbeat(self, gpu: int) -> None:
        self.inner.heartbeat(gpu)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        # Backend extras (the simulated backend's node, the NVML backend's event source)
        # stay reachable through the wrapper.
        return getattr(self.inner, name)
