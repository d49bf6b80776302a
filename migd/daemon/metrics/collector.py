"""migd's state metrics: read from the scheduler's books at scrape time (GPUs, MIG instances,
MPS devices, the queue, lease counts), so nothing is cached and the numbers match ``migctl
status --json`` taken at the same moment. The overview is :mod:`migd.daemon.metrics.service`'s
docstring.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from migd import __version__
from migd.core.gpus import ManagedGpu
from migd.core.leases import LeaseState
from migd.core.mps import MpsPool
from migd.core.scheduler import NodeScheduler
from migd.core.states import EMPTY
from migd.daemon.config import MigdConfig
from migd.ports import GpuInfo

MIB = 1024 * 1024
#: Lease states shown as gauges (the non-terminal ones).
LIVE_STATES = (LeaseState.QUEUED, LeaseState.PREPARING, LeaseState.ACTIVE)


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


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def allocated_mib(sched: NodeScheduler, gpu: ManagedGpu) -> int:
    """GPU memory promised to leases: leased MIG instances whole, MPS shares' pinned
    limits, a whole GPU for an exclusive lease (HAMi's "allocated", not what is used)."""
    return sched.mode_ops(gpu).allocated_mib(gpu)


class StateCollector(Collector):
    """Reads the daemon's books at scrape time (see the module docstring)."""

    def __init__(
        self,
        source: MetricsSource,
        *,
        mps_status: Callable[[str], list[dict[str, Any]]] | None = None,
        daemon_problem: Callable[[], str] | None = None,
        identifying: bool | None = None,
    ) -> None:
        self.source = source
        #: Lease and job id labels: fixed when the endpoint started (its token and address
        #: are), else the source's configuration decides.
        self.identifying = identifying
        self.mps_status = mps_status
        self.daemon_problem = daemon_problem or (lambda: "")

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
        # Which user's job runs where is the API's to show to its owner and admins: the
        # labels only with metrics.identifying_labels (a restricted listener).
        identify = self.identifying
        if identify is None:
            identify = self.source.config.metrics.identifying_labels
        identifying = ["lease_id", "job_id"] if identify else []
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
                *identifying,
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
            conditions = gpu.health.conditions
            g_healthy.add_metric([g], 0.0 if conditions else 1.0)
            for source in sorted(conditions):
                g_cond.add_metric([g, source], 1.0)
            g_draining.add_metric([g], 1.0 if gpu.draining else 0.0)
            g_available.add_metric([g], 1.0 if gpu.available else 0.0)
            g_total.add_metric([g], gpu.memory_total_mib * MIB)
            g_alloc.add_metric([g], allocated_mib(sched, gpu) * MIB)
            if gpu.used_mib is not None:
                g_used.add_metric([g], gpu.used_mib * MIB)
            if gpu.space is not None:  # a MIG GPU with a state machine
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
                        *(
                            [inst.lease_id or "", lease.request.job_id if lease else ""]
                            if identify
                            else []
                        ),
                    ],
                    1.0,
                )
                key = [g, inst.profile.name, start]
                i_mem.add_metric(key, inst.memory_mib * MIB)
                if inst.used_mib is not None:
                    i_used.add_metric(key, inst.used_mib * MIB)
                i_busy.add_metric(key, 1.0 if inst.busy else 0.0)
            pools: list[MpsPool] = [i.mps_pool for i in gpu.instances if i.mps_pool is not None]
            if gpu.mps_pool is not None:  # an MPS GPU's own pool
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
