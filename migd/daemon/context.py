"""What every part of the daemon shares: its configuration, its ports and its books.

One :class:`DaemonContext` is built by :class:`migd.daemon.service.Daemon` and handed to
each part (API server, lease service, GPU executor, reconciler, MPS supervisor, periodic
tasks). It holds no behaviour beyond accessors, so any part can be built in a test with
a context and the ports it needs, and no part imports another through it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from migd.core.mps import CgroupLimitBook
from migd.core.scheduler import NodeScheduler
from migd.daemon.api.auth import Authorizer
from migd.daemon.config import MigdConfig
from migd.daemon.store.state import StateStore
from migd.daemon.supervision.startd_check import StartdReport
from migd.daemon.systemd import Notifier
from migd.ports import CgroupMemoryLimits, Clock, GpuBackend, GpuInfo, MpsControl, ProcessTable


def _latency_series() -> collections.defaultdict[str, collections.deque[float]]:
    return collections.defaultdict(lambda: collections.deque(maxlen=2048))


@dataclass
class DaemonContext:
    """The shared state of one migd process (see the module docstring)."""

    config: MigdConfig
    backend: GpuBackend
    procs: ProcessTable
    clock: Clock
    notifier: Notifier
    auth: Authorizer
    mps: MpsControl | None = None
    #: MPS v3 per-cgroup memory limits (None: not offered); their books.
    cgroup_limits: CgroupMemoryLimits | None = None
    cgroup_book: CgroupLimitBook = field(default_factory=CgroupLimitBook)
    store: StateStore | None = None
    scheduler: NodeScheduler | None = None
    gpus: list[GpuInfo] = field(default_factory=list)
    #: Reconciliation findings for `migctl status`.
    notes: list[str] = field(default_factory=list)
    started_s: float = 0.0
    #: The last check of the startd's configuration (startd_check.py); None: none yet.
    startd_report: StartdReport | None = None
    #: Service time per op (decoded request to reply written), last 2048 each, for
    #: `migctl status` and the benchmark; see ``api_server.latency_class``.
    latency_s: collections.defaultdict[str, collections.deque[float]] = field(
        default_factory=_latency_series
    )

    @property
    def sched(self) -> NodeScheduler:
        assert self.scheduler is not None
        return self.scheduler

    @property
    def db(self) -> StateStore:
        assert self.store is not None
        return self.store

    def now(self) -> tuple[float, float]:
        """Wall-clock and monotonic time, in one call."""
        return self.clock.now(), self.clock.monotonic()
