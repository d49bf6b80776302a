"""Prometheus/OpenMetrics metrics for migd (every metric is documented in
docs/operations.md, Monitoring).

Two kinds of metric, kept apart so a scrape never has to trust a stale copy:

* **State** (:class:`StateCollector`): read from the scheduler's books at scrape time (GPUs,
  MIG instances, MPS devices, the queue, lease counts). Nothing is cached, so the numbers
  match ``migctl status --json`` taken at the same moment.
* **Events** (:class:`MetricsRecorder`): counters and histograms fed as things happen
  (lease transitions, refusals, wrapper restarts, NVML create/destroy calls, XID events).

Names follow the Prometheus conventions (base units, ``_total`` on counters, ``_info`` gauges
with value 1 that carry labels) and HAMi's metric set where one exists: the instance info
gauge is modelled on HAMi's ``hami_node_gpu_mig_instance_info``. Label cardinality stays
bounded: counters carry only small enumerations (mode, state, error code, operation, XID);
lease and job ids appear only on gauges that describe what exists now (one series per
live instance), never on counters.

The endpoint (:class:`MetricsServer`) is a small HTTP server on the daemon's own event loop,
not prometheus_client's threaded server: collection reads the scheduler, which only the
event loop may touch, so a scrape sees one consistent state and never races a lease change.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from migd import __version__
from migd.core.leases import LeaseState
from migd.core.mps import MpsPool
from migd.core.scheduler import GpuMode, Lease, ManagedGpu, NodeScheduler
from migd.core.states import EMPTY
from migd.daemon.config import MigdConfig
from migd.daemon.job_mapping import JobMappingWriter, job_mapping
from migd.errors import MigdError
from migd.ports import GpuBackend, GpuInfo, GpuProcess, MemoryInfo, MigInstance

log = structlog.get_logger("migd.metrics")

MIB = 1024 * 1024
#: NVML create/destroy take 0.1 s to several seconds ([Villarrubia] Table 1; driver-dependent).
NVML_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
#: Queueing: from an immediate grant to policy.max_wait_s (a day by default).
WAIT_BUCKETS = (0.0, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)
#: Lease states shown as gauges (the non-terminal ones).
LIVE_STATES = (LeaseState.QUEUED, LeaseState.PREPARING, LeaseState.ACTIVE)
#: Wrapper reports that mean the job was restarted in a bigger partition.
RESTART_EVENTS = {"oom": "oom", "forecast": "early"}


class MetricsSource(Protocol):
    """What the state collector reads: the daemon (or its shared context after the split)."""

    @property
    def config(self) -> MigdConfig: ...

    @property
    def sched(self) -> NodeScheduler: ...

    @property
    def gpus(self) -> list[GpuInfo]: ...

    @property
    def started_s(self) -> float: ...

    def now(self) -> tuple[float, float]: ...


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
            self.granted.labels(mode=lease.mode or "unknown").inc()
            self.wait.observe(max(0.0, now_s - lease.created_s))
        elif new.terminal:
            self.ended.labels(state=new.value).inc()

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


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def allocated_mib(sched: NodeScheduler, gpu: ManagedGpu) -> int:
    """GPU memory promised to leases: leased MIG instances whole, MPS shares' pinned
    limits, a whole GPU for an exclusive lease (HAMi's "allocated", not what is used)."""
    total = 0
    if gpu.mode is GpuMode.EXCLUSIVE:
        return gpu.memory_total_mib if gpu.exclusive_lease else 0
    if gpu.mode is GpuMode.MPS and gpu.mps_pool is not None:
        total += gpu.mps_pool.used_mib
    for inst in gpu.instances:
        if inst.lease_id is not None:
            total += inst.memory_mib
        elif inst.mps_pool is not None:
            total += inst.mps_pool.used_mib
    return total


class StateCollector(Collector):
    """Reads the daemon's books at scrape time (see the module docstring)."""

    def __init__(
        self,
        source: MetricsSource,
        *,
        mps_status: Callable[[str], list[dict[str, Any]]] | None = None,
        daemon_problem: Callable[[], str] | None = None,
        health_conditions: Callable[[ManagedGpu], Mapping[str, str]] | None = None,
    ) -> None:
        self.source = source
        self.mps_status = mps_status
        self.daemon_problem = daemon_problem or (lambda: "")
        self.health_conditions = health_conditions or _conditions

    def describe(self) -> list[Metric]:
        # Families depend on the state; an empty description keeps registration from
        # collecting (the scheduler may not exist yet when the collector is registered).
        return []

    def collect(self) -> Iterator[Metric]:
        src = self.source
        sched = src.sched
        now, mono = src.now()
        cfg = src.config

        info = InfoMetricFamily("migd_build", "migd's version and backend")
        info.add_metric([], {"version": __version__, "backend": cfg.backend.kind})
        yield info
        start = _gauge("migd_start_time_seconds", "When the daemon started (Unix time)")
        start.add_metric([], src.started_s)
        yield start
        problem = self.daemon_problem()
        healthy = _gauge(
            "migd_daemon_healthy",
            "1 while every GPU worker answers (the systemd watchdog is fed), else 0",
        )
        healthy.add_metric([], 0.0 if problem else 1.0)
        yield healthy

        yield from self._gpus(sched)
        yield from self._leases(sched, now, mono)

    def _gpus(self, sched: NodeScheduler) -> Iterator[Metric]:
        g_info = _gauge(
            "migd_gpu_info",
            "One series per GPU migd manages, value 1",
            ["gpu", "uuid", "model", "name", "mode"],
        )
        g_healthy = _gauge(
            "migd_gpu_healthy", "1 while the GPU has no health condition, else 0", ["gpu"]
        )
        g_cond = _gauge(
            "migd_gpu_health_condition",
            "1 per health condition a GPU has, by its source (xid, resync, mps, watchdog, ...)",
            ["gpu", "source"],
        )
        g_draining = _gauge("migd_gpu_draining", "1 while `migctl drain` holds the GPU", ["gpu"])
        g_available = _gauge(
            "migd_gpu_available", "1 when the GPU takes new leases (healthy, not draining)", ["gpu"]
        )
        g_total = _gauge("migd_gpu_memory_total_bytes", "GPU memory", ["gpu"])
        g_alloc = _gauge(
            "migd_gpu_memory_allocated_bytes",
            "GPU memory promised to leases (leased instances, MPS pinned limits, exclusive GPUs)",
            ["gpu"],
        )
        g_used = _gauge(
            "migd_gpu_memory_used_bytes",
            "GPU memory in use as last sampled (absent until the first sample)",
            ["gpu"],
        )
        g_reach = _gauge(
            "migd_gpu_reachability",
            "MIG GPUs: how many partitionings the current layout can still reach",
            ["gpu"],
        )
        g_reach_max = _gauge(
            "migd_gpu_reachability_max",
            "MIG GPUs: the reachability of an empty GPU (for a ratio)",
            ["gpu"],
        )
        i_info = _gauge(
            "migd_mig_instance_info",
            "One series per MIG instance, value 1 (modelled on HAMi's "
            "hami_node_gpu_mig_instance_info)",
            [
                "gpu",
                "gpu_uuid",
                "mig_uuid",
                "profile",
                "gpu_instance_id",
                "placement_start",
                "placement_size",
                "status",
                "origin",
                "lease_id",
                "job_id",
            ],
        )
        i_mem = _gauge(
            "migd_mig_instance_memory_bytes",
            "Memory of a MIG instance",
            ["gpu", "profile", "placement_start"],
        )
        i_used = _gauge(
            "migd_mig_instance_memory_used_bytes",
            "Memory in use in a MIG instance as last sampled",
            ["gpu", "profile", "placement_start"],
        )
        i_busy = _gauge(
            "migd_mig_instance_busy",
            "1 when the instance is leased, being changed, or not migd's to reuse",
            ["gpu", "profile", "placement_start"],
        )
        m_shares = _gauge("migd_mps_shares", "MPS shares on a device", ["gpu", "device_uuid"])
        m_pinned = _gauge(
            "migd_mps_pinned_memory_bytes",
            "Sum of the MPS shares' pinned memory limits on a device",
            ["gpu", "device_uuid"],
        )
        m_capacity = _gauge(
            "migd_mps_capacity_bytes",
            "What MPS shares may pin on a device (memory minus mps.reserve_mib)",
            ["gpu", "device_uuid"],
        )
        m_clients = _gauge(
            "migd_mps_clients",
            "MPS client processes: as the control daemon last listed them, else migd's count",
            ["gpu", "device_uuid"],
        )
        m_servers = _gauge(
            "migd_mps_servers",
            "Running MPS servers on a device, as the control daemon last listed them",
            ["gpu", "device_uuid"],
        )
        for gpu in sorted(sched.gpus.values(), key=lambda g: g.index):
            g = str(gpu.index)
            g_info.add_metric([g, gpu.uuid, gpu.model, gpu.name, gpu.mode.value], 1.0)
            conditions = self.health_conditions(gpu)
            g_healthy.add_metric([g], 0.0 if conditions else 1.0)
            for source in sorted(conditions):
                g_cond.add_metric([g, source], 1.0)
            g_draining.add_metric([g], 1.0 if gpu.draining else 0.0)
            g_available.add_metric([g], 1.0 if gpu.available else 0.0)
            g_total.add_metric([g], gpu.memory_total_mib * MIB)
            g_alloc.add_metric([g], allocated_mib(sched, gpu) * MIB)
            if gpu.used_mib is not None:
                g_used.add_metric([g], gpu.used_mib * MIB)
            if gpu.space is not None and gpu.mode is GpuMode.MIG:
                with contextlib.suppress(Exception):  # a layout the state space lacks
                    g_reach.add_metric([g], gpu.space.reachability(gpu.view().key))
                g_reach_max.add_metric([g], gpu.space.reachability(EMPTY))
            for inst in sorted(gpu.instances, key=lambda i: i.start):
                lease = sched.leases.get(inst.lease_id or "")
                start = str(inst.start)
                i_info.add_metric(
                    [
                        g,
                        gpu.uuid,
                        inst.uuid or "",
                        inst.profile.name,
                        "" if inst.gi_id is None else str(inst.gi_id),
                        start,
                        str(inst.profile.memory_slices),
                        inst.status.value,
                        inst.origin.value,
                        inst.lease_id or "",
                        lease.request.job_id if lease else "",
                    ],
                    1.0,
                )
                key = [g, inst.profile.name, start]
                i_mem.add_metric(key, inst.memory_mib * MIB)
                if inst.used_mib is not None:
                    i_used.add_metric(key, inst.used_mib * MIB)
                i_busy.add_metric(key, 1.0 if inst.busy else 0.0)
            pools: list[MpsPool] = [i.mps_pool for i in gpu.instances if i.mps_pool is not None]
            if gpu.mode is GpuMode.MPS and gpu.mps_pool is not None:
                pools.append(gpu.mps_pool)
            for pool in pools:
                key = [g, pool.device_uuid]
                m_shares.add_metric(key, len(pool.shares))
                m_pinned.add_metric(key, pool.used_mib * MIB)
                m_capacity.add_metric(key, pool.capacity_mib * MIB)
                listed = self.mps_status(pool.device_uuid) if self.mps_status else []
                servers = [s for d in listed for s in (d.get("servers") or [])]
                clients = [c for d in listed for c in (d.get("clients") or [])]
                read = any(d.get("age_s") is not None for d in listed)
                m_servers.add_metric(key, len(servers))
                m_clients.add_metric(key, len(clients) if read else pool.clients)
        yield from (g_info, g_healthy, g_cond, g_draining, g_available, g_total, g_alloc)
        yield from (g_used, g_reach, g_reach_max, i_info, i_mem, i_used, i_busy)
        yield from (m_shares, m_pinned, m_capacity, m_clients, m_servers)

    def _leases(self, sched: NodeScheduler, now: float, mono: float) -> Iterator[Metric]:
        counts = dict.fromkeys(LIVE_STATES, 0)
        for lease in sched.active_leases():
            if lease.state in counts:
                counts[lease.state] += 1
        leases = _gauge(
            "migd_leases", "Leases now, by state (queued, preparing, active)", ["state"]
        )
        for state, n in counts.items():
            leases.add_metric([state.value], n)
        yield leases
        waits = [item.age_s(mono) for item in sched.queue.order(mono)]
        length = _gauge("migd_queue_length", "Lease requests waiting for a partition")
        length.add_metric([], len(waits))
        yield length
        oldest = _gauge(
            "migd_queue_oldest_wait_seconds", "How long the longest-waiting request has waited"
        )
        oldest.add_metric([], max(waits, default=0.0))
        yield oldest


def _conditions(gpu: ManagedGpu) -> Mapping[str, str]:
    """A GPU's health conditions by source (migd.core.health)."""
    return {source: c.reason for source, c in gpu.health.conditions.items()}


def build_registry(
    source: MetricsSource,
    recorder: MetricsRecorder,
    **collector_options: Any,
) -> CollectorRegistry:
    """The recorder's registry with the state collector added."""
    recorder.registry.register(StateCollector(source, **collector_options))
    return recorder.registry


def render(registry: CollectorRegistry, accept: str = "") -> tuple[bytes, str]:
    """The exposition for an ``Accept`` header: OpenMetrics if asked, else Prometheus text."""
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


class MetricsServer:
    """``GET /metrics`` on the daemon's event loop (see the module docstring).

    Deliberately minimal HTTP/1.0: one request per connection, a size cap on the request
    head and a timeout, so a stuck or hostile client costs one short-lived task.
    """

    MAX_HEAD = 8192
    TIMEOUT_S = 10.0

    def __init__(self, registry: CollectorRegistry, listen: str) -> None:
        self.registry = registry
        host, _, port = listen.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        self._server: asyncio.Server | None = None

    @property
    def bound_port(self) -> int:
        """The port actually bound (``listen`` may name port 0 in tests)."""
        assert self._server is not None and self._server.sockets
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        log.info("metrics.listening", address=f"{self.host}:{self.bound_port}", path="/metrics")

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.TIMEOUT_S)
            status, body, content_type = self._answer(head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            status, body, content_type = "400 Bad Request", b"bad request\n", "text/plain"
        except ConnectionError:
            writer.close()
            return
        except Exception as exc:  # a collector bug must not take the daemon down
            log.exception("metrics.collect_failed", error=str(exc))
            status, body, content_type = "500 Internal Server Error", b"error\n", "text/plain"
        header = (
            f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        with contextlib.suppress(ConnectionError):
            writer.write(header + body)
            await writer.drain()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()

    def _answer(self, head: bytes) -> tuple[str, bytes, str]:
        if len(head) > self.MAX_HEAD:
            return "431 Request Header Fields Too Large", b"too large\n", "text/plain"
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3:
            return "400 Bad Request", b"bad request\n", "text/plain"
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", b"GET /metrics\n", "text/plain"
        if target.split("?", 1)[0] not in ("/metrics", "/"):
            return "404 Not Found", b"migd serves /metrics\n", "text/plain"
        accept = ""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        body, content_type = render(self.registry, accept)
        return "200 OK", b"" if method == "HEAD" else body, content_type


class MetricsService:
    """Everything metrics-related one daemon holds, built from its configuration.

    The daemon calls :meth:`wrap_backend` before discovery, :meth:`start` once its books
    exist, and :meth:`close` on shutdown; as a lease observer and an event observer
    (:mod:`migd.daemon.lease_service`) it hears of every lease transition, refusal and
    history record.
    """

    def __init__(self, config: MigdConfig) -> None:
        self.config = config.metrics
        self.recorder = MetricsRecorder()
        directory = self.config.dcgm_job_mapping_dir
        self.job_mapping = JobMappingWriter(directory) if directory is not None else None
        self.server: MetricsServer | None = None
        self._sched: Callable[[], NodeScheduler] | None = None
        # Leases restored at start-up pass through the daemon's save() before start();
        # they were granted by an earlier process and are not counted again.
        self._counting = False

    def wrap_backend(self, backend: GpuBackend) -> GpuBackend:
        return InstrumentedBackend(backend, self.recorder)

    async def start(self, source: MetricsSource, **collector_options: Any) -> None:
        build_registry(source, self.recorder, **collector_options)
        self._sched = lambda: source.sched
        self._counting = True
        self.sync_job_mapping()
        if self.config.listen:
            self.server = MetricsServer(self.recorder.registry, self.config.listen)
            try:
                await self.server.start()
            except OSError as exc:
                # A taken port must not keep GPUs from being served: log and go on.
                log.error(
                    "metrics.listen_failed",
                    address=self.config.listen,
                    error=str(exc),
                    hint="pick a free metrics.listen address and reload/restart migd",
                )
                self.server = None

    def on_transition(
        self, lease: Lease, old: LeaseState | None, new: LeaseState, now: float
    ) -> None:
        """A lease observer (:class:`migd.daemon.lease_service.LeaseObserver`)."""
        if not self._counting:
            return
        self.recorder.lease_changed(lease, new, now)
        if new is LeaseState.ACTIVE or new.terminal or old is LeaseState.ACTIVE:
            self.sync_job_mapping()

    def lease_refused(self, error: MigdError) -> None:
        self.recorder.lease_refused(error)

    def recorded(self, event: str, lease: Lease | None, data: Mapping[str, Any]) -> None:
        """A history record; the wrapper's reports (``wrapper.oom``, ...) are counted."""
        if event.startswith("wrapper."):
            self.recorder.wrapper_report(event.removeprefix("wrapper."))

    def sync_job_mapping(self) -> None:
        if self.job_mapping is not None and self._sched is not None:
            self.job_mapping.sync(job_mapping(self._sched()))

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
