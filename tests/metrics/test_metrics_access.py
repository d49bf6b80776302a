"""Issue 23, section 3: the metrics endpoint is not a side door. Identifying labels (lease
and job ids) are left out unless the admin opts in on a restricted listener (loopback and
a bearer token); a wildcard address is warned about; metrics connections are capped; a
scrape is encoded off the event loop, so it never holds up the API."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from migd.core.leases import Lease, LeaseRequest
from migd.core.scheduler import NodeScheduler
from migd.daemon.config import MigdConfig, validate_config
from migd.daemon.metrics.exporter import MetricsServer, listen_warnings, render
from migd.daemon.metrics.recorder import MetricsRecorder
from migd.daemon.metrics.service import MetricsService, build_registry
from migd.errors import ConfigError
from tests.metrics.conftest import finish, gpu
from tests.metrics.test_metrics import Source, _http, scrape


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Wait on the event loop for ``cond``; fail after ``timeout_s`` saying what for."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _leased() -> tuple[NodeScheduler, str, str]:
    node = NodeScheduler([gpu(0)])
    request = LeaseRequest("schedd#77.0#1700000000", 9000, wait_s=60.0)
    out = node.submit(Lease("1700000000-c0ffee00", request, 1000, 1, 0.0), 1000.0, 10.0)
    finish(node, out.work, 1001.0)
    return node, out.lease.lease_id, out.lease.request.job_id


def _token_config(tmp_path: Path, **metrics: Any) -> MigdConfig:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    return validate_config(
        {"metrics": {"listen": "127.0.0.1:0", "bearer_token_file": str(token), **metrics}}
    )


def test_lease_and_job_ids_are_not_labels_by_default() -> None:
    node, lease_id, job_id = _leased()
    registry = build_registry(Source(node), MetricsRecorder())
    samples = scrape(registry)
    info = samples["migd_mig_instance_info"]
    assert info and all(not {"lease_id", "job_id"} & set(labels) for labels, _ in info)
    body = render(registry)[0].decode()  # the exposition as served
    assert f'"{lease_id}"' not in body and f'"{job_id}"' not in body


def test_identifying_labels_when_opted_in_on_a_restricted_listener(tmp_path: Path) -> None:
    node, lease_id, job_id = _leased()
    config = _token_config(tmp_path, identifying_labels=True)
    registry = build_registry(Source(node, config=config), MetricsRecorder())
    info = scrape(registry)["migd_mig_instance_info"]
    assert [(ls["lease_id"], ls["job_id"]) for ls, _ in info] == [(lease_id, job_id)]


@pytest.mark.parametrize(
    ("metrics", "needle"),
    [
        ({"listen": "127.0.0.1:9464", "identifying_labels": True}, "bearer_token_file"),
        ({"identifying_labels": True, "bearer_token_file": "/x"}, "listen"),
        (
            {"listen": "0.0.0.0:9464", "identifying_labels": True, "bearer_token_file": "/x"},
            "loopback",
        ),
        (
            {"listen": "[::]:9464", "identifying_labels": True, "bearer_token_file": "/x"},
            "loopback",
        ),
    ],
)
def test_identifying_labels_are_refused_on_an_open_listener(
    metrics: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ConfigError) as err:
        validate_config({"metrics": metrics})
    assert "identifying_labels" in str(err.value) and needle in str(err.value)


def test_a_wildcard_address_is_warned_about() -> None:
    for listen in ("0.0.0.0:9464", "[::]:9464"):
        (warning,) = listen_warnings(validate_config({"metrics": {"listen": listen}}))
        assert "every address" in warning and "metrics.listen" in warning
    for listen in ("127.0.0.1:9464", "[::1]:9464", "10.1.2.3:9464", ""):
        assert listen_warnings(validate_config({"metrics": {"listen": listen}})) == []


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    config = _token_config(tmp_path)
    assert config.metrics.bearer_token_file is not None
    config.metrics.bearer_token_file.chmod(0o644)
    server = MetricsServer(
        build_registry(Source(NodeScheduler([gpu(0)])), MetricsRecorder()), config.metrics
    )
    with pytest.raises(ConfigError, match="readable by others"):
        asyncio.run(server.start())


def test_with_a_token_file_a_scrape_needs_the_token(tmp_path: Path) -> None:
    config = _token_config(tmp_path)
    registry = build_registry(Source(NodeScheduler([gpu(0)])), MetricsRecorder())

    async def main() -> list[bytes]:
        server = MetricsServer(registry, config.metrics)
        await server.start()
        try:
            port = server.bound_port
            return [
                await _http(port, b"GET /metrics HTTP/1.1\r\n\r\n"),
                await _http(port, b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer nope\r\n\r\n"),
                await _http(port, b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer s3cret\r\n\r\n"),
            ]
        finally:
            await server.close()

    missing, wrong, right = asyncio.run(main())
    assert missing.startswith(b"HTTP/1.0 401") and b"WWW-Authenticate: Bearer" in missing
    assert wrong.startswith(b"HTTP/1.0 401")
    assert right.startswith(b"HTTP/1.0 200") and b"migd_gpu_info" in right


def test_connections_over_the_cap_get_503_at_once() -> None:
    registry = build_registry(Source(NodeScheduler([gpu(0)])), MetricsRecorder())
    section = validate_config({"metrics": {"listen": "127.0.0.1:0", "max_connections": 2}}).metrics

    async def main() -> tuple[bytes, bytes]:
        server = MetricsServer(registry, section)
        await server.start()
        idle = []
        try:
            port = server.bound_port
            for _ in range(2):  # connected, sending nothing: each holds a slot
                idle.append(await asyncio.open_connection("127.0.0.1", port))
            await until(lambda: server.connections == 2, "the server to accept both")
            over = await _http(port, b"GET /metrics HTTP/1.1\r\n\r\n")
            for _, writer in idle:
                writer.close()
            await until(lambda: not server.connections, "the slots to be given back")
            after = await _http(port, b"GET /metrics HTTP/1.1\r\n\r\n")
            return over, after
        finally:
            await server.close()

    over, after = asyncio.run(main())
    assert over.startswith(b"HTTP/1.0 503") and b"metrics.max_connections" in over
    assert after.startswith(b"HTTP/1.0 200")


class _SlowToEncode(Metric):  # type: ignore[misc]
    """A family whose samples are read (by the encoder) only once ``release`` is set: the
    scrape is then stuck in encoding until the test lets it go."""

    def __init__(self, entered: threading.Event, release: threading.Event) -> None:
        super().__init__("slow_gauge", "waits while being encoded", "gauge")
        self._real = GaugeMetricFamily("slow_gauge", "waits while being encoded", value=1.0)
        self._entered, self._release = entered, release
        self.timed_out = False

    @property  # type: ignore[override]
    def samples(self) -> list[Any]:
        self._entered.set()
        if not self._release.wait(timeout=20):
            self.timed_out = True
        return list(self._real.samples)

    @samples.setter
    def samples(self, value: list[Any]) -> None:
        pass


class _SlowCollector(Collector):  # type: ignore[misc]
    def __init__(self, metric: _SlowToEncode) -> None:
        self.metric = metric

    def collect(self) -> Iterator[Metric]:
        yield self.metric

    def describe(self) -> list[Metric]:
        return []


def test_a_scrape_is_encoded_off_the_event_loop() -> None:
    """While a scrape is being encoded, the event loop (which serves the API) runs: it sees
    the encoder waiting and lets it go. A loop blocked in the encoder would only go on
    once the encoder gave up waiting (timed_out)."""
    entered, release = threading.Event(), threading.Event()
    slow = _SlowToEncode(entered, release)
    registry = build_registry(Source(NodeScheduler([gpu(0)])), MetricsRecorder())
    registry.register(_SlowCollector(slow))
    section = validate_config({"metrics": {"listen": "127.0.0.1:0"}}).metrics

    async def main() -> tuple[bool, bytes]:
        server = MetricsServer(registry, section)
        await server.start()
        try:
            scrape_task = asyncio.ensure_future(
                _http(server.bound_port, b"GET /metrics HTTP/1.1\r\n\r\n")
            )
            await until(entered.is_set, "the scrape to reach the encoder")
            ran_while_encoding = not release.is_set()  # this coroutine ran meanwhile
            release.set()
            return ran_while_encoding, await scrape_task
        finally:
            release.set()
            await server.close()

    ran_while_encoding, body = asyncio.run(main())
    assert ran_while_encoding and not slow.timed_out
    assert body.startswith(b"HTTP/1.0 200") and b"slow_gauge 1.0" in body


def test_parallel_scrapes_share_one_collection() -> None:
    """Scrapes that arrive while one is being collected and encoded get that one's
    result: N parallel scrapes cost the loop one collection, not N."""
    calls = 0

    class Counting(Collector):  # type: ignore[misc]
        def collect(self) -> Iterator[Metric]:
            nonlocal calls
            calls += 1
            yield GaugeMetricFamily("counted", "how many collections", value=1.0)

        def describe(self) -> list[Metric]:
            return []

    entered, release = threading.Event(), threading.Event()
    registry = build_registry(Source(NodeScheduler([gpu(0)])), MetricsRecorder())
    registry.register(_SlowCollector(_SlowToEncode(entered, release)))
    registry.register(Counting())
    section = validate_config({"metrics": {"listen": "127.0.0.1:0"}}).metrics

    async def main() -> list[bytes]:
        server = MetricsServer(registry, section)
        await server.start()
        try:
            first = asyncio.ensure_future(_http(server.bound_port, b"GET / HTTP/1.1\r\n\r\n"))
            await until(entered.is_set, "the first scrape to reach the encoder")
            others = [
                asyncio.ensure_future(_http(server.bound_port, b"GET / HTTP/1.1\r\n\r\n"))
                for _ in range(3)
            ]
            await until(lambda: server.sharing == 3, "three scrapes to share the first's")
            release.set()
            return [await first, *[await o for o in others]]
        finally:
            release.set()
            await server.close()

    bodies = asyncio.run(main())
    assert all(b.startswith(b"HTTP/1.0 200") for b in bodies)
    assert calls == 1


def test_check_config_warns_about_a_wildcard_address() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "migd", "--check-config", "--set", "metrics.listen=[::]:9464"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "warning: metrics.listen = '[::]:9464' serves /metrics on every address" in done.stderr


def test_starting_on_a_wildcard_address_logs_a_warning() -> None:
    config = validate_config({"metrics": {"listen": "0.0.0.0:0"}})
    service = MetricsService(config)

    async def main() -> None:
        await service.start(Source(NodeScheduler([gpu(0)]), config=config))
        await service.close()

    with structlog.testing.capture_logs() as logs:
        asyncio.run(main())
    (warned,) = [e for e in logs if e["event"] == "metrics.wildcard_address"]
    assert warned["log_level"] == "warning" and "every address" in warned["reason"]


def test_a_reload_cannot_add_identifying_labels_to_a_running_endpoint(tmp_path: Path) -> None:
    """The endpoint's token is read when it starts: labels turned on by a later reload
    (whose file names a token) would be served without one."""
    node, lease_id, _ = _leased()
    started = validate_config({"metrics": {"listen": "127.0.0.1:0"}})
    source = Source(node, config=started)
    service = MetricsService(started)

    async def main() -> bytes:
        await service.start(source)
        try:
            source.config = _token_config(tmp_path, identifying_labels=True)  # the reload
            assert service.server is not None
            return await _http(service.server.bound_port, b"GET /metrics HTTP/1.0\r\n\r\n")
        finally:
            await service.close()

    body = asyncio.run(main())
    assert body.startswith(b"HTTP/1.0 200") and b"migd_mig_instance_info" in body
    assert b"lease_id" not in body and lease_id.encode() not in body
