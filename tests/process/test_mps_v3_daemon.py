"""Issue 25: migd as a process on a simulated node whose driver does (r615) or does not
(r580, the lent machines') support MPS v3 per-cgroup memory limits: an MPS lease that
names its job cgroup gets that cgroup limited, the limit is cleared at release, and
`migctl status` says whether such limits are in force and why not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.process.conftest import DaemonProcess, wait_for

JOB = "/htcondor/condor_var_lib_condor_execute_slot1_1@node"


def start(daemon: DaemonProcess, driver: str) -> Path:
    """A one-GPU node (MIG off, in MPS mode) with ``driver``, and a cgroup v2 tree under
    the test's root holding the job's cgroup, as HTCondor makes one per job."""
    cgroups = daemon.root / "cgroup"
    (cgroups / JOB.lstrip("/")).mkdir(parents=True)
    (cgroups / "cgroup.controllers").write_text("cpu memory dmem\n")
    (cgroups / JOB.lstrip("/") / "cgroup.procs").write_text("")
    node = daemon.root / "node.toml"
    node.write_text(f'driver_version = "{driver}"\n[[gpu]]\nmodel = "A100-40GB"\nmig = false\n')
    daemon.simulate = str(node)
    daemon.config_text = 'version = 1\n[[gpu]]\nmatch = "0"\nmode = "mps"\n'
    daemon.extra_args = ["--set", f'mps.cgroup_root="{cgroups}"']
    daemon.start()
    return cgroups


def limits_status(daemon: DaemonProcess) -> dict[str, Any]:
    status: dict[str, Any] = daemon.status_json()["gpus"][0]["mps"]["cgroup_limits"]
    return status


def events(daemon: DaemonProcess, name: str) -> list[dict[str, Any]]:
    return [e for e in daemon.log_events() if e.get("event") == name]


@pytest.mark.timeout(300)
def test_an_r615_driver_limits_the_job_cgroup_for_the_lease_and_clears_it(
    daemon: DaemonProcess,
) -> None:
    cgroups = start(daemon, "615.10.01")
    client = daemon.client()
    lease = client.lease(
        job_id="v3.0", gpu_memory_mib=4096, mode="mps", mps_clients=2, cgroup=JOB, wait_s=30
    )
    assert limits_status(daemon) == {"in_force": True, "leases": 1, "why_not": ""}
    (applied,) = events(daemon, "mps.cgroup_limit")
    # limit x clients: the cgroup holds every process of the job together.
    assert applied["cgroup"] == f"{cgroups}{JOB}" and applied["hard_mib"] == 8192
    # An older wrapper's lease (no cgroup) runs on the pinned limit alone.
    client.lease(job_id="v3.1", gpu_memory_mib=1024, mode="mps", wait_s=30)
    assert len(events(daemon, "mps.cgroup_limit")) == 1
    client.release(lease["lease_id"], "done")
    wait_for(
        lambda: events(daemon, "mps.cgroup_limit_cleared"),
        timeout_s=60,
        what="the job cgroup's limit to be cleared at release",
    )
    status = limits_status(daemon)
    assert status["in_force"] is False and status["leases"] == 0


@pytest.mark.timeout(300)
def test_an_r580_driver_is_asked_nothing_and_status_says_why(daemon: DaemonProcess) -> None:
    start(daemon, "580.159.04")
    client = daemon.client()
    lease = client.lease(job_id="v2.0", gpu_memory_mib=4096, mode="mps", cgroup=JOB, wait_s=30)
    assert lease["lease_id"]  # the lease is granted all the same
    status = limits_status(daemon)
    assert status["in_force"] is False and "older than r615" in status["why_not"]
    (skipped,) = events(daemon, "mps.cgroup_limit_skipped")
    assert "older than r615" in skipped["reason"]
    assert not events(daemon, "mps.cgroup_limit") and not events(daemon, "mps.cgroup_limit_failed")
