"""MPS through the real daemon: a simulated non-MIG GPU, the stand-in control daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

from tests.process.conftest import DaemonProcess, wait_for
from tests.process.test_daemon_process import NOBODY, as_user
from tests.process.test_wrapper_process import SIMJOB, run


def mps_status(daemon: DaemonProcess) -> dict[str, Any]:
    gpu = daemon.client().status()["gpus"][0]
    assert gpu["mode"] == "mps"
    mps: dict[str, Any] = gpu["mps"]
    return mps


def test_mps_lease_gets_a_pinned_limit_and_its_own_daemon(daemon: DaemonProcess) -> None:
    daemon.simulate = "1xV100-32GB"
    daemon.start()
    lease = daemon.client().lease(job_id="m.0", gpu_memory_mib=4000, wait_s=5)
    env = lease["env"]
    assert lease["mode"] == "mps"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4000M"
    pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
    assert pipe.is_relative_to(daemon.root / "run")  # private, per GPU, not /tmp/nvidia-mps
    assert (pipe / "nvidia-cuda-mps-control.pid").exists()
    status = mps_status(daemon)
    assert status["pinned_mib"] == 4000 and status["uid"] == os.getuid()
    [control] = status["daemons"]
    os.kill(int(control["pid"]), 0)  # the control daemon runs
    daemon.client().release(lease["lease_id"])
    assert mps_status(daemon)["shares"] == []


def test_client_over_its_limit_is_an_oom_and_restarts_bigger(daemon: DaemonProcess) -> None:
    daemon.simulate = "1xV100-32GB"
    daemon.start()
    result = run(
        daemon,
        "--gpu-memory",
        "2G",
        "--job-id",
        "mo.0",
        "--",
        *SIMJOB,
        "--start",
        "1G",
        "--grow",
        "1G",
        "--steps",
        "3",
        "--step-s",
        "0.01",
    )
    assert result.returncode == 0, result.stderr
    assert "CUDA out of memory" in result.stderr
    assert "MPS share of 2048 MiB" in result.stderr and "MPS share of 4096 MiB" in result.stderr


def test_one_user_at_a_time_per_mps_server(daemon: DaemonProcess) -> None:
    daemon.simulate = "1xV100-32GB"
    daemon.config_text = 'version = 1\n[api]\nlease_users = ["*"]\n'
    # the per-user MPS daemon runs as the job's user, who cannot execute this venv's python
    daemon.env["MIGD_FAKE_MPS_PYTHON"] = "/usr/bin/python3"
    daemon.start()
    mine = daemon.client().lease(job_id="root.0", gpu_memory_mib=1000, wait_s=5)
    code = f"""
import json
from migd.client import MigdClient
c = MigdClient({str(daemon.socket_path)!r}, timeout_s=60)
print(json.dumps(c.lease(job_id="nobody.0", gpu_memory_mib=1000, wait_s=30)))
"""
    got: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: got.update(result=as_user(NOBODY, code)))
    waiter.start()
    wait_for(lambda: daemon.client().status()["queue"], what="the other user's request to wait")
    assert mps_status(daemon)["draining_for_uid"] == NOBODY
    # while it drains, the serving user gets nothing new either (no starvation)
    blocked = daemon.client().call("leases")["leases"]
    assert any(x["job_id"] == "nobody.0" and x["state"] == "queued" for x in blocked)
    daemon.client().release(mine["lease_id"])
    waiter.join(60)
    result = got["result"]
    assert result.returncode == 0, result.stderr
    theirs = json.loads(result.stdout)
    assert theirs["state"] == "active" and theirs["owner_uid"] == NOBODY
    assert mps_status(daemon)["uid"] == NOBODY


def test_sigterm_keeps_a_busy_mps_daemon_and_restart_adopts_it(daemon: DaemonProcess) -> None:
    daemon.simulate = "1xV100-32GB"
    holder = subprocess.Popen(["sleep", "120"])
    try:
        daemon.start()
        daemon.client().lease(job_id="k.0", gpu_memory_mib=1000, wait_s=5, holder_pid=holder.pid)
        [control] = mps_status(daemon)["daemons"]
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0
        os.kill(int(control["pid"]), 0)  # still serving the running job
        daemon.proc = None
        daemon.notifications.clear()  # wait for the new daemon's READY=1, not the old one's
        daemon.start()
        status = mps_status(daemon)
        assert [d["pid"] for d in status["daemons"]] == [control["pid"]]
        assert status["pinned_mib"] == 1000
    finally:
        holder.kill()
        holder.wait()
