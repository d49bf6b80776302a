"""Prometheus/OpenMetrics metrics for migd (every metric is documented in
docs/operations.md, Monitoring).

Two kinds of metric, kept apart so a scrape never has to trust a stale copy:

* **State** (:mod:`migd.daemon.metrics.collector`): read from the scheduler's books at
  scrape time (GPUs, MIG instances, MPS devices, the queue, lease counts). Nothing is
  cached, so the numbers match ``migctl status --json`` taken at the same moment.
* **Events** (:mod:`migd.daemon.metrics.recorder`): counters and histograms fed as things
  happen (lease transitions, refusals, wrapper restarts, NVML create/destroy calls, XID
  events).

Names follow the Prometheus conventions (base units, ``_total`` on counters, ``_info`` gauges
with value 1 that carry labels) and HAMi's metric set where one exists: the instance info
gauge is modelled on HAMi's ``hami_node_gpu_mig_instance_info``. Label cardinality stays
bounded: counters carry only small enumerations (mode, state, error code, operation, XID);
lease and job ids appear only on gauges that describe what exists now (one series per
live instance), never on counters, and only when the admin opts in on a restricted
listener (``metrics.identifying_labels``: they say which user's job runs where).

The endpoint (:mod:`migd.daemon.metrics.exporter`) is a small HTTP server with a thread and
event loop of its own, not prometheus_client's threaded server: collection reads the
scheduler, which only the daemon's event loop may touch, so it is handed to that loop (a
scrape sees one consistent state and never races a lease change), while connections are
handled and the collected families encoded off it.

This module ties the parts together: :class:`MetricsService` is what one daemon holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from migd.core.leases import Lease, LeaseState
from migd.core.scheduler import NodeScheduler
from migd.daemon.config import MigdConfig
from migd.daemon.metrics.collector import MetricsSource, StateCollector
from migd.daemon.metrics.exporter import MetricsServer, listen_warnings
from migd.daemon.metrics.job_mapping import JobMappingWriter, job_mapping
from migd.daemon.metrics.recorder import InstrumentedBackend, MetricsRecorder
from migd.errors import ConfigError, MigdError
from migd.ports import GpuBackend

log = structlog.get_logger("migd.metrics")


def build_registry(
    source: MetricsSource,
    recorder: MetricsRecorder,
    **collector_options: Any,
) -> CollectorRegistry:
    """The recorder's registry with the state collector added."""
    recorder.registry.register(StateCollector(source, **collector_options))
    return recorder.registry


class MetricsService:
    """Everything metrics-related one daemon holds, built from its configuration.

    The daemon calls :meth:`wrap_backend` before discovery, :meth:`start` once its books
    exist, and :meth:`close` on shutdown; as a lease observer and an event observer
    (:mod:`migd.daemon.leases.service`) it hears of every lease transition, refusal and
    history record.
    """

    def __init__(self, config: MigdConfig) -> None:
        self.config = config.metrics
        self.full_config = config
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
        # The endpoint's token and address are read now, once: a reload that turns the
        # identifying labels on must not add them to an endpoint started without a token.
        collector_options.setdefault("identifying", self.config.identifying_labels)
        build_registry(source, self.recorder, **collector_options)
        self._sched = lambda: source.sched
        self._counting = True
        self.sync_job_mapping()
        if self.config.listen:
            for warning in listen_warnings(self.full_config):
                log.warning("metrics.wildcard_address", address=self.config.listen, reason=warning)
            self.server = MetricsServer(self.recorder.registry, self.config)
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
            except ConfigError as exc:
                # A token file others can read: no endpoint rather than an open one.
                log.error(
                    "metrics.listen_failed",
                    address=self.config.listen,
                    error=exc.message,
                    where=exc.where,
                    hint=exc.hint,
                )
                await self.server.close()
                self.server = None

    def on_transition(
        self, lease: Lease, old: LeaseState | None, new: LeaseState, now: float
    ) -> None:
        """A lease observer (:class:`migd.daemon.leases.service.LeaseObserver`)."""
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
