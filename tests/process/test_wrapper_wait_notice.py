"""A job that waits inside migd for its partition says so (stderr and job ad)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from migd.core.condor_shares import share_id
from tests.process.conftest import DaemonProcess, wait_for
from tests.process.test_wrapper_process import fake_chirp
from tests.process.test_wrapper_signals import AD, start


def test_a_job_waiting_for_its_partition_says_so_then_how_long(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    # Both 40 GB GPUs held by others: the job (matched on an older ad, as HTCondor
    # does) waits inside migd. Before, it sat "Running" with nothing saying why.
    holder = subprocess.Popen(["sleep", "300"])
    try:
        daemon.start()
        client = daemon.client()
        held = [
            client.lease(job_id=f"other.{n}", gpu_memory_mib=40000, wait_s=5, holder_pid=holder.pid)
            for n in range(2)
        ]
        calls = tmp_path / "chirp.log"
        env = {
            **fake_chirp(tmp_path, f'echo "$@" >> {calls}'),
            "MIGD_WRAPPER_WAIT_NOTICE_S": "0.5",
        }
        ad = AD.replace("RequestVRAM = 4000", "RequestVRAM = 40000") + "MigdWaitSeconds = 120\n"
        proc = start(daemon, tmp_path, ad, "/bin/true", env=env)
        chirped = lambda: calls.read_text() if calls.exists() else ""  # noqa: E731
        wait_for(lambda: "MigdWaitReason" in chirped(), what="the wait to be announced")
        assert proc.poll() is None
        client.release(held[0]["lease_id"], reason="test")
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        assert "waiting inside migd since" in stderr
        assert "no free partition of 40000 MiB" in stderr and "in migd's queue" in stderr
        assert "waited " in stderr and " s for the partition" in stderr
        lines = chirped().splitlines()
        assert any(x.startswith("set_job_attr MigdWaitingSince ") for x in lines), lines
        assert any(x.startswith("set_job_attr MigdWaitedSeconds ") for x in lines), lines
        assert 'set_job_attr MigdWaitReason ""' in lines
        client.release(held[1]["lease_id"], reason="test")
    finally:
        holder.kill()
        holder.wait()


def test_a_job_granted_at_once_says_nothing_about_waiting(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    daemon.start()
    calls = tmp_path / "chirp.log"
    env = {**fake_chirp(tmp_path, f'echo "$@" >> {calls}'), "MIGD_WRAPPER_WAIT_NOTICE_S": "30"}
    proc = start(daemon, tmp_path, AD, "/bin/true", env=env)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "waiting inside migd" not in stderr
    assert "MigdWait" not in calls.read_text()


def test_a_job_pinned_to_a_busy_gpu_while_another_is_free_says_so(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    # Issue 22 §7: HTCondor gave the slot a share of GPU 0 (claim reuse, first free share)
    # while GPU 0 runs a whole-GPU job and GPU 1 is idle; the wrapper must lease on GPU 0
    # (device hiding), so it waits: it says where a partition would be free now.
    holder = subprocess.Popen(["sleep", "300"])
    try:
        daemon.start()
        client = daemon.client()
        gpus = client.status()["gpus"]
        busy = client.lease(
            job_id="other.0",
            gpu_memory_mib=40000,
            wait_s=5,
            holder_pid=holder.pid,
            gpus=[gpus[0]["uuid"]],
        )
        machine = tmp_path / "machine.ad"
        machine.write_text(
            f'Name = "slot1_1@node"\nAssignedGPUs = "{share_id(gpus[0]["uuid"], 3)}"\n'
        )
        calls = tmp_path / "chirp.log"
        env = {
            **fake_chirp(tmp_path, f'echo "$@" >> {calls}'),
            "MIGD_WRAPPER_WAIT_NOTICE_S": "0.5",
            "_CONDOR_MACHINE_AD": str(machine),
        }
        ad = AD.replace("RequestVRAM = 4000", "RequestVRAM = 40000") + "MigdWaitSeconds = 120\n"
        proc = start(daemon, tmp_path, ad, "/bin/true", env=env)
        chirped = lambda: calls.read_text() if calls.exists() else ""  # noqa: E731
        wait_for(lambda: "MigdWaitReason" in chirped(), what="the wait to be announced")
        [reason] = [x for x in chirped().splitlines() if x.startswith("set_job_attr MigdWaitR")]
        assert f"GPU {gpus[1]['index']} of this node could serve it now" in reason, reason
        client.release(busy["lease_id"], reason="test")
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        assert f"GPU {gpus[0]['index']})" in stderr  # the lease landed on the assigned GPU
    finally:
        holder.kill()
        holder.wait()
