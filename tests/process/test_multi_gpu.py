"""``migd-run --gpus N`` against the real daemon on a simulated 2-GPU node (2xA100-40GB):
one partition on each GPU, all or none, every device in ``CUDA_VISIBLE_DEVICES``, and
an out-of-memory restart that moves every GPU of the job to a bigger partition."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any

from tests.process.conftest import DaemonProcess, wait_for
from tests.process.test_wrapper_process import SIMJOB, run


def visible_devices(stdout: str) -> list[str]:
    found = re.search(r"^CUDA_VISIBLE_DEVICES=(.*)$", stdout, re.M)
    assert found, stdout
    return found.group(1).split(",")


def granted(daemon: DaemonProcess, job_id: str) -> list[dict[str, Any]]:
    history = daemon.client().call("history", job_id=job_id, limit=200)["history"]
    return [h for h in history if h["event"] == "granted"]


def test_two_gpus_one_partition_each_all_listed(daemon: DaemonProcess) -> None:
    daemon.start()
    result = run(
        daemon,
        *("--gpus", "2", "--gpu-memory", "3G", "--job-id", "two.0", "--"),
        *SIMJOB,
        *("--print-env", "--start", "1G", "--steps", "1", "--step-s", "0.01"),
    )
    assert result.returncode == 0, result.stderr
    devices = visible_devices(result.stdout)
    assert len(devices) == 2 and all(d.startswith("MIG-") for d in devices), devices
    grants = granted(daemon, "two.0")
    assert sorted(g["data"]["gpu"] for g in grants) == [0, 1]  # one on each GPU
    assert sorted(g["data"]["mig_uuid"] for g in grants) == sorted(devices)
    assert "2 GPUs" in result.stderr
    assert daemon.client().call("leases")["leases"] == []  # both released


def test_a_group_waits_whole_while_one_gpu_is_full(daemon: DaemonProcess) -> None:
    """GPU 1 is full: the job's member for GPU 0 takes nothing while it waits, and both
    are granted together once GPU 1 frees."""
    daemon.start()
    holder = daemon.client()
    blocker = holder.lease(job_id="full.0", gpu_memory_mib=39_000, gpus=["1"], wait_s=0)
    assert blocker["gpu"] == 1
    job = subprocess.Popen(
        [
            *(sys.executable, "-m", "migd.wrapper.main", "--socket", str(daemon.socket_path)),
            *("--gpus", "2", "--gpu-memory", "3G", "--wait", "300", "--job-id", "wait.0", "--"),
            *(*SIMJOB, "--print-env", "--start", "1G", "--steps", "1", "--step-s", "0.01"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "MIGD_API_SOCKET": str(daemon.socket_path)},
    )
    try:

        def queued() -> list[dict[str, Any]]:
            leases = daemon.client().call("leases")["leases"]
            return [x for x in leases if x["job_id"] == "wait.0"]

        wait_for(lambda: len(queued()) == 2, timeout_s=60, what="both leases of wait.0 to queue")
        mine = queued()
        assert [x["state"] for x in mine] == ["queued", "queued"], mine
        status = daemon.client().call("status")
        gpu0 = next(g for g in status["gpus"] if g["index"] == 0)
        assert gpu0["instances"] == [], gpu0  # nothing taken on the free GPU
        holder.release(blocker["lease_id"])
        out, err = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, err
    assert len(visible_devices(out)) == 2
    assert sorted(g["data"]["gpu"] for g in granted(daemon, "wait.0")) == [0, 1]


def test_out_of_memory_on_one_gpu_moves_every_gpu_bigger(daemon: DaemonProcess) -> None:
    daemon.start()
    result = run(
        daemon,
        *("--gpus", "2", "--gpu-memory", "3G", "--job-id", "oom2.0", "--"),
        *SIMJOB,
        *("--start", "3G", "--grow", "1G", "--steps", "4", "--step-s", "0.01"),
    )
    assert result.returncode == 0, result.stderr
    assert "CUDA out of memory" in result.stderr
    assert "restarting on a bigger partition" in result.stderr
    grants = granted(daemon, "oom2.0")
    by_profile: dict[str, list[int]] = {}
    for g in grants:
        by_profile.setdefault(g["data"]["profile"], []).append(g["data"]["gpu"])
    # Two grants per attempt, one on each GPU: the first pair 1g.5gb, then a bigger pair.
    assert len(grants) == 4, grants
    assert sorted(by_profile) != ["1g.5gb"] and "1g.5gb" in by_profile, by_profile
    assert all(sorted(gpus) == [0, 1] for gpus in by_profile.values()), by_profile


def test_a_waiting_job_that_dies_leaves_no_member_behind(daemon: DaemonProcess) -> None:
    """The wrapper is killed while its group waits: migd sees the connection close and
    ends both leases (none stays queued, none is granted later)."""
    daemon.start()
    holder = daemon.client()
    blocker = holder.lease(job_id="full.1", gpu_memory_mib=39_000, gpus=["0"], wait_s=0)
    job = subprocess.Popen(
        [
            *(sys.executable, "-m", "migd.wrapper.main", "--socket", str(daemon.socket_path)),
            *("--gpus", "2", "--gpu-memory", "3G", "--wait", "300", "--job-id", "dies.0", "--"),
            *(*SIMJOB, "--start", "1G", "--steps", "1"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "MIGD_API_SOCKET": str(daemon.socket_path)},
    )

    def mine() -> list[dict[str, Any]]:
        leases = daemon.client().call("leases")["leases"]
        return [x for x in leases if x["job_id"] == "dies.0"]

    try:
        wait_for(lambda: len(mine()) == 2, timeout_s=60, what="both leases of dies.0 to queue")
    finally:
        job.kill()
        job.wait()
    wait_for(lambda: mine() == [], timeout_s=60, what="both leases of dies.0 to end")
    history = daemon.client().call("history", job_id="dies.0", limit=50)["history"]
    assert not [h for h in history if h["event"] == "granted"], history
    holder.release(blocker["lease_id"])
