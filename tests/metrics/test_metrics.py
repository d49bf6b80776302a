"""migd's metrics: the state collector against the scheduler's books, the event counters,
the NVML timing wrapper and the HTTP endpoint (no daemon process; see test_scrape.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from migd.core.gpus import ManagedGpu, MpsState
from migd.core.leases import LeaseState
from migd.core.scheduler import NodeScheduler
from migd.daemon.config import MigdConfig, validate_config
from migd.daemon.metrics.collector import MIB
from migd.daemon.metrics.exporter import MetricsServer, render
from migd.daemon.metrics.recorder import InstrumentedBackend, MetricsRecorder
from migd.daemon.metrics.service import build_registry
from migd.errors import GpuError, NoCapacity
from migd.ports import GpuInfo, MigInstance
from tests.metrics.conftest import finish, gpu, lease


@dataclass
class Source:
    """The daemon as the collector sees it."""

    sched: NodeScheduler
    config: MigdConfig = field(default_factory=MigdConfig)
    gpus: list[GpuInfo] = field(default_factory=list)
    started_s: float = 1000.0
    t: float = 1000.0
    mono: float = 50.0

    def now(self) -> tuple[float, float]:
        return self.t, self.mono


Samples = dict[str, list[tuple[dict[str, str], float]]]

#: An endpoint on a loopback port the kernel picks.
LOCAL = validate_config({"metrics": {"listen": "127.0.0.1:0"}}).metrics
#: The admin's opt-in to lease and job id labels (loopback and a token; the collector does
#: not read the token file).
IDENTIFYING = validate_config(
    {
        "metrics": {
            "listen": "127.0.0.1:9464",
            "bearer_token_file": "/etc/migd/metrics.token",
            "identifying_labels": True,
        }
    }
)


def scrape(registry: Any, accept: str = "") -> Samples:
    body, _ = render(registry, accept)
    out: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    rows = samples.get(name, [])
    matches = [v for ls, v in rows if all(ls.get(k) == x for k, x in labels.items())]
    assert len(matches) == 1, f"{name}{labels}: {matches} in {samples.get(name)}"
    return matches[0]


def test_instances_memory_and_queue_read_from_the_books() -> None:
    node = NodeScheduler([gpu(0), gpu(1)])
    node.gpus[1].draining = True
    src = Source(node, config=IDENTIFYING)
    recorder = MetricsRecorder()
    registry = build_registry(src, recorder)
    first = node.submit(lease(9000), 1000.0, 10.0)
    finish(node, first.work, 1001.0)
    assert first.lease.state is LeaseState.ACTIVE
    # Fill the rest of GPU 0 so the next request queues.
    big = node.submit(lease(19000), 1001.0, 11.0)
    finish(node, big.work, 1002.0)
    queued = node.submit(lease(19000), 1002.0, 20.0)
    assert queued.lease.state is LeaseState.QUEUED
    node.gpus[0].used_mib = 1234
    samples = scrape(registry)

    info = [ls for ls, _ in samples["migd_mig_instance_info"] if ls["gpu"] == "0"]
    assert {(i["profile"], i["placement_start"], i["job_id"]) for i in info} == {
        (first.lease.profile, str(first.lease.start), first.lease.request.job_id),
        (big.lease.profile, str(big.lease.start), big.lease.request.job_id),
    }
    one = next(i for i in info if i["lease_id"] == first.lease.lease_id)
    assert one["gpu_uuid"] == "GPU-0000" and one["mig_uuid"].startswith("MIG-0-")
    assert one["gpu_instance_id"] and one["status"] == "ready"
    leased = first.lease.memory_limit_mib
    assert leased is not None
    expected_alloc = sum(i.memory_mib for i in node.gpus[0].instances if i.lease_id)
    assert value(samples, "migd_gpu_memory_allocated_bytes", gpu="0") == expected_alloc * MIB
    assert value(samples, "migd_gpu_memory_allocated_bytes", gpu="1") == 0
    assert value(samples, "migd_gpu_memory_used_bytes", gpu="0") == 1234 * MIB
    assert "1" not in {ls["gpu"] for ls, _ in samples.get("migd_gpu_memory_used_bytes", [])}
    total = node.gpus[1].memory_total_mib * MIB
    assert value(samples, "migd_gpu_memory_total_bytes", gpu="1") == total
    assert value(samples, "migd_leases", state="active") == 2
    assert value(samples, "migd_leases", state="queued") == 1
    assert value(samples, "migd_queue_length") == 1
    assert value(samples, "migd_queue_oldest_wait_seconds") == pytest.approx(30.0)
    assert value(samples, "migd_gpu_available", gpu="1") == 0
    assert value(samples, "migd_gpu_draining", gpu="1") == 1
    assert value(samples, "migd_gpu_healthy", gpu="1") == 1
    # Reachability falls as instances are placed; an empty GPU has the maximum.
    reach0 = value(samples, "migd_gpu_reachability", gpu="0")
    assert reach0 < value(samples, "migd_gpu_reachability_max", gpu="0")
    assert value(samples, "migd_gpu_reachability", gpu="1") == value(
        samples, "migd_gpu_reachability_max", gpu="1"
    )
    assert value(samples, "migd_build_info", backend="nvml") == 1
    assert value(samples, "migd_daemon_healthy") == 1


def test_an_unhealthy_gpu_and_a_stuck_daemon_show() -> None:
    node = NodeScheduler([gpu(0)])
    node.gpus[0].health.raise_("xid", "XID 79: GPU has fallen off the bus", 0.0)
    registry = build_registry(
        Source(node), MetricsRecorder(), daemon_problem=lambda: "an NVML call hung"
    )
    samples = scrape(registry)
    assert value(samples, "migd_gpu_healthy", gpu="0") == 0
    assert value(samples, "migd_gpu_available", gpu="0") == 0
    assert value(samples, "migd_daemon_healthy") == 0
    assert [ls["source"] for ls, _ in samples["migd_gpu_health_condition"]] == ["xid"]


def test_mps_devices_count_shares_pinned_memory_and_listed_processes() -> None:
    v100 = ManagedGpu(0, "GPU-0000", "V100-32GB", "Tesla V100", 32768, MpsState())
    node = NodeScheduler([v100])
    out = node.submit(lease(4000), 1000.0, 1.0)
    finish(node, out.work, 1000.0)
    assert out.lease.state is LeaseState.ACTIVE
    listed = [{"servers": [41], "clients": [42, 43], "age_s": 0.5}]
    registry = build_registry(
        Source(node), MetricsRecorder(), mps_status=lambda uuid: listed if uuid else []
    )
    samples = scrape(registry)
    assert value(samples, "migd_mps_shares", gpu="0") == 1
    assert value(samples, "migd_mps_pinned_memory_bytes", gpu="0") == 4000 * MIB
    assert value(samples, "migd_mps_servers", gpu="0") == 1
    assert value(samples, "migd_mps_clients", gpu="0") == 2
    assert value(samples, "migd_gpu_memory_allocated_bytes", gpu="0") == 4000 * MIB


def test_lease_transitions_count_by_mode_and_final_state_with_the_wait() -> None:
    recorder = MetricsRecorder()
    node = NodeScheduler([gpu(0)])
    registry = build_registry(Source(node), recorder)
    granted = lease(5000, created_s=100.0)
    granted.mode = "mig"
    recorder.lease_changed(granted, LeaseState.ACTIVE, 112.5)
    recorder.lease_changed(granted, LeaseState.RELEASED, 200.0)
    recorder.lease_refused(NoCapacity("no partition"))
    recorder.wrapper_report("oom")
    recorder.wrapper_report("forecast")
    recorder.wrapper_report("forecast")
    recorder.wrapper_report("exit")  # not a restart
    samples = scrape(registry)
    assert value(samples, "migd_leases_granted_total", mode="mig") == 1
    assert value(samples, "migd_leases_granted_total", mode="mps") == 0
    assert value(samples, "migd_leases_ended_total", state="released") == 1
    assert value(samples, "migd_leases_ended_total", state="expired") == 0
    assert value(samples, "migd_leases_refused_total", reason="no_capacity") == 1
    assert value(samples, "migd_lease_wait_seconds_sum") == pytest.approx(12.5)
    assert value(samples, "migd_lease_wait_seconds_bucket", le="15.0") == 1
    assert value(samples, "migd_lease_wait_seconds_bucket", le="5.0") == 0
    assert value(samples, "migd_job_restarts_total", kind="oom") == 1
    assert value(samples, "migd_job_restarts_total", kind="early") == 2
    # Bounded cardinality: no counter carries a lease or job id.
    for name, rows in samples.items():
        if name.endswith(("_total", "_bucket", "_sum", "_count")):
            for labels, _ in rows:
                assert not {"lease_id", "job_id"} & set(labels), name


class FlakyBackend:
    def __init__(self) -> None:
        self.fail_destroy = False

    def create_instance(self, gpu: int, profile_id: int, start: int) -> MigInstance:
        return MigInstance(gpu, 1, profile_id, start, 1, 5120)

    def destroy_instance(self, gpu: int, gi_id: int) -> None:
        if self.fail_destroy:
            raise GpuError("In use by another client")

    def extra(self) -> str:
        return "reachable"


def test_nvml_create_and_destroy_are_counted_and_timed_by_result() -> None:
    recorder = MetricsRecorder()
    inner = FlakyBackend()
    backend = InstrumentedBackend(inner, recorder)  # type: ignore[arg-type]
    assert backend.create_instance(0, 19, 6).gi_id == 1
    backend.destroy_instance(0, 1)
    inner.fail_destroy = True
    with pytest.raises(GpuError):
        backend.destroy_instance(0, 1)
    assert backend.extra() == "reachable"  # backend extras pass through
    samples = scrape(recorder.registry)
    assert value(samples, "migd_nvml_operations_total", op="create", result="ok") == 1
    assert value(samples, "migd_nvml_operations_total", op="destroy", result="ok") == 1
    assert value(samples, "migd_nvml_operations_total", op="destroy", result="gpu_error") == 1
    assert value(samples, "migd_nvml_operation_seconds_count", op="destroy") == 2


def test_openmetrics_is_served_when_asked_for() -> None:
    registry = build_registry(Source(NodeScheduler([gpu(0)])), MetricsRecorder())
    body, content_type = render(registry, "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")
    _, plain = render(registry, "")
    assert plain.startswith("text/plain")


async def _http(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await reader.read()
    writer.close()
    return data


def test_the_endpoint_answers_get_metrics_and_refuses_the_rest() -> None:
    registry = build_registry(Source(NodeScheduler([gpu(0)])), MetricsRecorder())

    async def main() -> list[bytes]:
        server = MetricsServer(registry, LOCAL)
        await server.start()
        try:
            port = server.bound_port
            return [
                await _http(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
                await _http(port, b"GET /other HTTP/1.1\r\n\r\n"),
                await _http(port, b"POST /metrics HTTP/1.1\r\n\r\n"),
                await _http(port, b"garbage\r\n\r\n"),
            ]
        finally:
            await server.close()

    ok, missing, post, garbage = asyncio.run(main())
    assert ok.startswith(b"HTTP/1.0 200 OK")
    assert b'migd_gpu_info{gpu="0"' in ok
    assert missing.startswith(b"HTTP/1.0 404")
    assert post.startswith(b"HTTP/1.0 405")
    assert garbage.startswith(b"HTTP/1.0 400")


def test_two_recorders_never_share_a_number() -> None:
    a, b = MetricsRecorder(), MetricsRecorder()
    a.wrapper_report("oom")
    assert value(scrape(b.registry), "migd_job_restarts_total", kind="oom") == 0


def test_a_failing_collector_answers_500_and_the_endpoint_keeps_serving() -> None:
    node = NodeScheduler([gpu(0)])
    source = Source(node)
    registry = build_registry(source, MetricsRecorder())

    async def main() -> tuple[bytes, bytes]:
        server = MetricsServer(registry, LOCAL)
        await server.start()
        try:
            source.sched = None  # type: ignore[assignment]  # a bug in the books
            broken = await _http(server.bound_port, b"GET /metrics HTTP/1.0\r\n\r\n")
            source.sched = node
            fixed = await _http(server.bound_port, b"GET /metrics HTTP/1.0\r\n\r\n")
            return broken, fixed
        finally:
            await server.close()

    broken, fixed = asyncio.run(main())
    assert broken.startswith(b"HTTP/1.0 500")
    assert fixed.startswith(b"HTTP/1.0 200")
