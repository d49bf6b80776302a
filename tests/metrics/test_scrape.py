"""A migd process on simulated GPUs serves /metrics; the values agree with
``migctl status --json``, DCGM's job mapping files name its jobs, and a real Prometheus
(Debian's ``prometheus`` package, installed by scripts/test.sh) scrapes it."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from migd.errors import MigdError
from tests.process.conftest import DaemonProcess, started_daemon, wait_for

MIB = 1024 * 1024
pytestmark = pytest.mark.slow


TOKEN = "scrape-token-for-the-test"


def _token_file(root: Path) -> Path:
    path = root / "metrics.token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def node(tmp_path: Path) -> Iterator[DaemonProcess]:
    """migd on two simulated A100s with the endpoint on a loopback port the kernel picks,
    a bearer token and the lease and job id labels (the admin's opt-in, issue 23 s3)."""
    with started_daemon(
        tmp_path,
        "m",
        config=lambda root: (
            "version = 1\n[metrics]\nlisten = '127.0.0.1:0'\n"
            f"dcgm_job_mapping_dir = '{root / 'dcgm-map'}'\n"
            f"bearer_token_file = '{_token_file(root)}'\nidentifying_labels = true\n"
        ),
        extra_args=["--set", "backend.sim_time_scale=0"],
    ) as proc:
        yield proc


def metrics_url(node: DaemonProcess) -> str:
    event = wait_for(
        lambda: next((e for e in node.log_events() if e.get("event") == "metrics.listening"), None),
        what="metrics.listening in the log",
    )
    return f"http://{event['address']}/metrics"


def get(url: str) -> Any:
    """GET ``url`` with the scrape token."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    return urllib.request.urlopen(request, timeout=10)


def load(node: DaemonProcess) -> dict[str, Any]:
    """Two MIG leases on GPU 0 and one on GPU 1, a refusal, and a wrapper's OOM report."""
    client = node.client()
    small = client.lease(job_id="1.0", gpu_memory_mib=4000, wait_s=5)
    big = client.lease(job_id="2.0", gpu_memory_mib=19000, wait_s=5, gpus=[small["gpu_uuid"]])
    other = next(g for g in node.status_json()["gpus"] if g["uuid"] != small["gpu_uuid"])
    third = client.lease(job_id="3.0", gpu_memory_mib=9000, wait_s=5, gpus=[other["uuid"]])
    with pytest.raises(MigdError):
        client.lease(job_id="4.0", gpu_memory_mib=500_000, wait_s=5)
    client.call("report", lease_id=third["lease_id"], event="oom", data={})
    return {"small": small, "big": big, "third": third}


Series = list[tuple[dict[str, str], float]]


def parse(text: str) -> dict[str, Series]:
    out: dict[str, Series] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def check_against_status(series: dict[str, Series], status: dict[str, Any]) -> None:
    """Every per-GPU and per-instance value the status shows, as the metrics show it."""

    def one(name: str, **labels: str) -> float:
        rows = [
            v for ls, v in series.get(name, []) if all(ls.get(k) == x for k, x in labels.items())
        ]
        assert len(rows) == 1, (name, labels, series.get(name))
        return rows[0]

    for gpu in status["gpus"]:
        g = str(gpu["index"])
        assert one("migd_gpu_info", gpu=g, uuid=gpu["uuid"], mode=gpu["mode"]) == 1
        assert one("migd_gpu_memory_total_bytes", gpu=g) == gpu["memory_total_mib"] * MIB
        assert one("migd_gpu_healthy", gpu=g) == (1 if gpu["healthy"] else 0)
        assert one("migd_gpu_draining", gpu=g) == (1 if gpu["draining"] else 0)
        assert one("migd_gpu_reachability", gpu=g) == gpu["reachability"]
        assert one("migd_gpu_reachability_max", gpu=g) == gpu["reachability_max"]
        leased = sum(i["memory_mib"] for i in gpu["instances"] if i["lease_id"])
        assert one("migd_gpu_memory_allocated_bytes", gpu=g) == leased * MIB
        shown = {
            (
                ls["profile"],
                ls["placement_start"],
                ls["gpu_instance_id"],
                ls["lease_id"],
                ls["job_id"],
            )
            for ls, _ in series["migd_mig_instance_info"]
            if ls["gpu"] == g
        }
        assert shown == {
            (i["profile"], str(i["start"]), str(i["gi_id"]), i["lease_id"] or "", i["job_id"] or "")
            for i in gpu["instances"]
        }
        for inst in gpu["instances"]:
            size = one("migd_mig_instance_memory_bytes", gpu=g, placement_start=str(inst["start"]))
            assert size == inst["memory_mib"] * MIB
    for state, count in status["leases"].items():
        assert one("migd_leases", state=state) == count
    assert one("migd_queue_length") == len(status["queue"])


def test_the_endpoint_agrees_with_migctl_status_and_dcgm_names_the_jobs(
    node: DaemonProcess,
) -> None:
    url = metrics_url(node)
    leases = load(node)
    with get(url) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        series = parse(reply.read().decode())
    status = node.status_json()
    check_against_status(series, status)
    assert [v for ls, v in series["migd_leases_granted_total"] if ls["mode"] == "mig"] == [3]
    refused = {ls["reason"]: v for ls, v in series["migd_leases_refused_total"]}
    assert sum(refused.values()) == 1, refused
    assert [v for ls, v in series["migd_job_restarts_total"] if ls["kind"] == "oom"] == [1]
    creates = [v for ls, v in series["migd_nvml_operations_total"] if ls["op"] == "create"]
    assert sum(creates) >= 3
    # DCGM exporter's files: <gpu>.<gi> holding the job id, for each leased instance.
    expected = {
        f"{g['index']}.{i['gi_id']}": f"{i['job_id']}\n"
        for g in status["gpus"]
        for i in g["instances"]
        if i["lease_id"]
    }
    mapping = node.root / "dcgm-map"
    assert {p.name: p.read_text() for p in mapping.iterdir()} == expected
    assert sorted(expected.values()) == ["1.0\n", "2.0\n", "3.0\n"]
    node.client().release(leases["big"]["lease_id"])
    wait_for(lambda: len(list(mapping.iterdir())) == 2, what="the released job's file to go")


def _listening_port(pid: int) -> int | None:
    for conn in psutil.Process(pid).net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN:
            port: int = conn.laddr.port
            return port
    return None


def _query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with get(url) as reply:
        data = json.loads(reply.read())
    assert data["status"] == "success", data
    result: list[dict[str, Any]] = data["data"]["result"]
    return result


@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="Debian's prometheus package is not installed (scripts/test.sh installs it when "
    "run as root with apt-get; `apt-get install prometheus` by hand otherwise)",
)
def test_a_real_prometheus_scrapes_the_node(node: DaemonProcess, tmp_path: Path) -> None:
    target = urllib.parse.urlparse(metrics_url(node)).netloc
    load(node)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: migd\n    static_configs:\n"
        f"      - targets: ['{target}']\n"
        f"    authorization:\n      credentials_file: {node.root / 'metrics.token'}\n"
    )
    log = (tmp_path / "prometheus.log").open("wb")
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            "--web.listen-address=127.0.0.1:0",  # the kernel picks; read back below
        ],
        stdout=log,
        stderr=log,
    )
    try:
        port = wait_for(
            lambda: _listening_port(prom.pid), timeout_s=30, what="prometheus to listen"
        )
        base = f"http://127.0.0.1:{port}"

        def scraped() -> list[dict[str, Any]] | None:
            try:
                rows = _query(base, 'up{job="migd"} == 1')
            except OSError:
                return None
            return rows or None

        wait_for(scraped, timeout_s=60, what="prometheus to scrape migd")
        status = node.status_json()
        # Rebuild the scraped series from Prometheus's own answers, then check them the
        # way the direct scrape is checked.
        series: dict[str, Series] = {}
        for name in (
            "migd_gpu_info",
            "migd_gpu_memory_total_bytes",
            "migd_gpu_healthy",
            "migd_gpu_draining",
            "migd_gpu_reachability",
            "migd_gpu_reachability_max",
            "migd_gpu_memory_allocated_bytes",
            "migd_mig_instance_info",
            "migd_mig_instance_memory_bytes",
            "migd_leases",
            "migd_queue_length",
        ):
            rows = _query(base, name)
            series[name] = [
                (
                    {
                        k: v
                        for k, v in r["metric"].items()
                        if k not in ("__name__", "instance", "job")
                    },
                    float(r["value"][1]),
                )
                for r in rows
            ]
        check_against_status(series, status)
        granted = _query(base, 'migd_leases_granted_total{mode="mig"}')
        assert float(granted[0]["value"][1]) == 3
        ooms = _query(base, 'migd_job_restarts_total{kind="oom"}')
        assert float(ooms[0]["value"][1]) == 1
    finally:
        prom.terminate()
        try:
            prom.wait(20)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait(5)
        log.close()
