"""A GPU fails under load on a live migd (a daemon process on simulated GPUs): NVML XID
events are injected with the ``sim_xid`` op and the node must take the GPU out of service,
flag the running leases, tell the jobs whose work is lost, and say so in status, metrics,
slot ads and history."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from migd.errors import MigdError
from tests.process.conftest import DaemonProcess, started_daemon, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def node(tmp_path: Path) -> Iterator[DaemonProcess]:
    with started_daemon(
        tmp_path,
        "h",
        config_text=(
            "version = 1\n[metrics]\nlisten = '127.0.0.1:0'\n"
            # The test drives the admin-only sim_xid op and `migctl resume` as itself: by
            # uid, which needs no passwd entry (a container's uid may have none).
            f"[api]\nadmin_users = ['{os.getuid()}']\n"
        ),
        extra_args=["--set", "backend.sim_time_scale=0"],
    ) as proc:
        yield proc


def scrape(node: DaemonProcess) -> str:
    event = next(e for e in node.log_events() if e.get("event") == "metrics.listening")
    with urllib.request.urlopen(f"http://{event['address']}/metrics", timeout=10) as reply:
        text: str = reply.read().decode()
    return text


def lease_view(node: DaemonProcess, lease_id: str) -> dict[str, Any]:
    view: dict[str, Any] = node.client().call("get_lease", lease_id=lease_id)
    return view


def test_a_gpu_failing_under_load_is_taken_out_of_service(node: DaemonProcess) -> None:
    client = node.client()
    gpus = node.status_json()["gpus"]
    uuid0, uuid1 = gpus[0]["uuid"], gpus[1]["uuid"]
    on0 = client.lease(job_id="10.0", gpu_memory_mib=9000, wait_s=5, gpus=[uuid0])
    on1 = client.lease(job_id="11.0", gpu_memory_mib=9000, wait_s=5, gpus=[uuid1])
    other1 = client.lease(job_id="12.0", gpu_memory_mib=9000, wait_s=5, gpus=[uuid1])
    assert on0["gpu"] == 0 and on1["gpu"] == 1 == other1["gpu"]

    # 1. An application fault (XID 13) is counted and nothing else happens.
    client.call("sim_xid", gpu=0, xid=13)
    wait_for(
        lambda: 'migd_gpu_xid_events_total{critical="false",gpu="0",xid="13"} 1.0' in scrape(node),
        what="XID 13 counted",
    )
    assert node.status_json()["gpus"][0]["healthy"] is True
    assert lease_view(node, on0["lease_id"])["warning"] == ""

    # 2. XID 79: the GPU falls off the bus. No new leases there, its job is told.
    client.call("sim_xid", gpu=0, xid=79)
    gpu0 = wait_for(
        lambda: next(g for g in node.status_json()["gpus"] if g["index"] == 0 and not g["healthy"]),
        what="GPU 0 unhealthy",
    )
    assert "XID 79 (GPU has fallen off the bus)" in gpu0["health"]
    warning = lease_view(node, on0["lease_id"])["warning"]
    assert warning.startswith("GPU lost: XID 79"), warning
    assert lease_view(node, on1["lease_id"])["warning"] == ""  # the other GPU is fine
    with pytest.raises(MigdError):
        client.lease(job_id="13.0", gpu_memory_mib=4000, wait_s=0, gpus=[uuid0])
    moved = client.lease(job_id="14.0", gpu_memory_mib=4000, wait_s=5)
    assert moved["gpu"] == 1
    metrics = scrape(node)
    assert 'migd_gpu_xid_events_total{critical="true",gpu="0",xid="79"} 1.0' in metrics
    assert 'migd_gpu_health_condition{gpu="0",source="xid"} 1.0' in metrics
    assert 'migd_gpu_healthy{gpu="0"} 0.0' in metrics
    assert 'migd_gpu_available{gpu="1"} 1.0' in metrics
    ad = node.migctl("condor-ad", "--per-gpu").stdout
    gpu0_ad = ad.split("- migd_gpu0")[0].split("- migd\n")[1]
    assert "MigdGpuHealthy = false" in gpu0_ad and "XID 79" in gpu0_ad, ad
    assert "MigdHealthy = true" in ad  # GPU 1 still serves
    explained = json.loads(node.migctl("explain", "10.0", "--json").stdout)
    assert explained["leases"][0]["warning"].startswith("GPU lost:")
    assert any(row["event"] == "gpu.event" for row in explained.get("history", [])) or any(
        row["event"] == "gpu.event" for row in client.call("history", limit=50)["history"]
    )
    # The wrapper learns it from the release reply and has HTCondor run the job again.
    released = client.release(on0["lease_id"])
    assert released["gpu_lost"].startswith("GPU lost: XID 79")

    # 3. An XID NVML attributes to one GPU instance loses that instance's job only.
    instances = {i["lease_id"]: i for i in node.status_json()["gpus"][1]["instances"]}
    gi = instances[on1["lease_id"]]["gi_id"]
    client.call("sim_xid", gpu=1, xid=94, gi_id=gi, ci_id=0)
    wait_for(lambda: lease_view(node, on1["lease_id"])["warning"], what="lease on the GI flagged")
    assert lease_view(node, on1["lease_id"])["warning"].startswith("GPU lost: XID 94")
    assert lease_view(node, other1["lease_id"])["warning"] == ""
    assert not node.status_json()["gpus"][1]["healthy"]

    # 4. The admin judges GPU 1 fine: `migctl resume` clears the condition.
    assert node.migctl("resume", "1").returncode == 0
    assert node.status_json()["gpus"][1]["healthy"] is True
    assert client.lease(job_id="15.0", gpu_memory_mib=4000, wait_s=5, gpus=[uuid1])["gpu"] == 1


def test_configured_xids_are_injected_at_start_and_bad_ones_refused(tmp_path: Path) -> None:
    with started_daemon(
        tmp_path,
        "hc",
        config_text="version = 1\n[health]\nsim_xids = ['1:48']\n",
        extra_args=["--set", "backend.sim_time_scale=0"],
    ) as proc:
        gpu1 = wait_for(
            lambda: next(
                g for g in proc.status_json()["gpus"] if g["index"] == 1 and not g["healthy"]
            ),
            what="GPU 1 unhealthy from health.sim_xids",
        )
        assert "XID 48 (double-bit ECC error)" in gpu1["health"]
        assert proc.status_json()["gpus"][0]["healthy"] is True
        with pytest.raises(MigdError, match="no GPU 7"):
            proc.client().call("sim_xid", gpu=7, xid=79)
