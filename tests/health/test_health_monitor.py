"""The GPU health monitor's verdicts on the books, without a daemon process: which leases
an event flags, and the xid condition in both health models (one string today, the agreed
``GpuHealth`` condition set: raise_/clear/conditions)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from migd.backends.nvml.events import EVENT_XID_CRITICAL, classify
from migd.core.gpus import ManagedGpu
from migd.core.lease_end import LeaseEndReason
from migd.core.leases import LeaseState
from migd.core.scheduler import NodeScheduler
from migd.daemon.config import MigdConfig
from migd.daemon.metrics.exporter import render
from migd.daemon.metrics.service import MetricsService
from migd.daemon.supervision.gpu_health import GpuHealthMonitor, clear_condition, raise_condition
from migd.ports import ManualClock
from tests.metrics.conftest import finish, gpu, lease


@dataclass
class Books:
    """The parts of the daemon context and lease service the monitor uses."""

    sched: NodeScheduler
    config: MigdConfig = field(default_factory=MigdConfig)
    clock: ManualClock = field(default_factory=ManualClock)
    saved: list[str] = field(default_factory=list)
    records: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    applied: list[Any] = field(default_factory=list)  # outcomes handed back

    def save(self, lease: Any) -> None:
        self.saved.append(lease.lease_id)

    def record(self, event: str, lease: Any, /, **data: Any) -> None:
        self.records.append((event, data))

    def now(self) -> tuple[float, float]:
        return self.clock.now(), self.clock.monotonic()

    def apply(self, outcome: Any) -> None:
        self.applied.append(outcome)


def monitor(books: Books) -> GpuHealthMonitor:
    return GpuHealthMonitor(books, books, MetricsService(books.config), events=object())  # type: ignore[arg-type]


def node_with_two_leases() -> tuple[NodeScheduler, Any, Any]:
    node = NodeScheduler([gpu(0), gpu(1)])
    first = node.submit(lease(9000, gpu_uuids=("GPU-0000",)), 1.0, 1.0)
    second = node.submit(lease(9000, gpu_uuids=("GPU-0000",)), 1.0, 1.0)
    finish(node, first.work + second.work, 2.0)
    assert first.lease.state is second.lease.state is LeaseState.ACTIVE
    return node, first.lease, second.lease


def test_an_xid_on_one_instance_flags_only_its_lease() -> None:
    node, a, b = node_with_two_leases()
    books = Books(node)
    inst = node.gpus[0].instance_of(a.lease_id)
    assert inst is not None
    event = classify(0, EVENT_XID_CRITICAL, 94, inst.gi_id or 0, 0)
    assert event is not None
    flagged = monitor(books).apply(event)
    assert [x.lease_id for x in flagged] == [a.lease_id]
    assert a.warning.startswith("GPU lost: XID 94") and b.warning == ""
    # The job must stop: a typed end reason on the still-active lease, none on the other.
    assert a.end_reason is LeaseEndReason.GPU_LOST and a.state is LeaseState.ACTIVE
    assert b.end_reason is None
    assert not node.gpus[0].available and node.gpus[1].available
    assert books.saved == [a.lease_id]
    assert books.records[0][0] == "gpu.event" and books.records[0][1]["xid"] == 94


def reasons(gpu: ManagedGpu) -> dict[str, str]:
    return {source: c.reason for source, c in gpu.health.conditions.items()}


def test_an_unattributed_non_fatal_xid_flags_every_lease_but_loses_none() -> None:
    node, a, b = node_with_two_leases()
    books = Books(node)
    health = monitor(books)
    event = classify(0, EVENT_XID_CRITICAL, 74)  # NVLink error
    assert event is not None
    assert {x.lease_id for x in health.apply(event)} == {a.lease_id, b.lease_id}
    assert a.end_reason is None and "no new leases" in a.warning
    assert reasons(node.gpus[0]) == {"xid": str(node.gpus[0].health)}
    assert reasons(node.gpus[1]) == {}
    body, _ = render(health.metrics.recorder.registry)
    assert b'migd_gpu_xid_events_total{critical="true",gpu="0",xid="74"} 1.0' in body
    assert health.clear(0) and node.gpus[0].available
    assert len(books.applied) == 1  # a scheduling pass for what the GPU can take again
    assert not health.clear(0)  # nothing left to clear


def test_an_ignored_xid_changes_nothing() -> None:
    node, a, _ = node_with_two_leases()
    event = classify(0, EVENT_XID_CRITICAL, 43)
    assert event is not None
    assert monitor(Books(node)).apply(event) == []
    assert node.gpus[0].available and a.warning == ""


def test_the_xid_condition_leaves_other_sources_conditions_alone() -> None:
    g = gpu(0)
    g.health.raise_("mps", "MPS daemon down", 1.0)
    raise_condition(g, "XID 79 ...", 5.0)
    assert set(g.health.conditions) == {"mps", "xid"}
    assert reasons(g) == {"mps": "MPS daemon down", "xid": "XID 79 ..."}
    assert clear_condition(g) and not clear_condition(g)
    assert set(g.health.conditions) == {"mps"}
    assert not g.health.available
