"""The real daemon (simulated GPUs, persisted) against a faulty state disk and bad clients."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator

import pytest

from migd.errors import StateDiskError
from tests.faults.conftest import SmallDisk, mount_small_disk, unmount
from tests.process.conftest import DaemonProcess, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def state_disk(daemon: DaemonProcess) -> Iterator[SmallDisk]:
    """The daemon's state directory on a 768 KiB tmpfs."""
    disk = mount_small_disk(daemon.root / "state")
    try:
        yield disk
    finally:
        daemon.stop()
        unmount(disk)


def _three_leases(
    daemon: DaemonProcess, sleepers: list[subprocess.Popen[bytes]]
) -> list[dict[str, object]]:
    daemon.extra_args += ["--set", f"backend.sim_state_file={daemon.root / 'sim-gpus.json'}"]
    daemon.start()
    leases = []
    for n in range(3):
        holder = subprocess.Popen(["sleep", "120"])
        sleepers.append(holder)
        leases.append(
            daemon.client().lease(
                job_id=f"1.{n}", gpu_memory_mib=4000, wait_s=10, holder_pid=holder.pid
            )
        )
    daemon.signal(signal.SIGTERM)
    assert daemon.wait() == 0
    return leases


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_faulty_state_disk_at_start_exits_for_a_retry_and_loses_no_lease(
    daemon: DaemonProcess,
    state_disk: SmallDisk,
    sleepers: list[subprocess.Popen[bytes]],
    fault: str,
) -> None:
    leases = _three_leases(daemon, sleepers)
    db = state_disk.path / "migd.db"
    saved = db.read_bytes()
    if fault == "full":
        state_disk.fill()
    else:
        state_disk.read_only()
    offset = daemon.log_path.stat().st_size
    daemon.start(wait_ready=False)
    code = daemon.wait()
    assert code not in (0, 2)  # non-zero: Restart=on-failure retries; 2 is a config error
    failed = [
        e
        for e in daemon.log_events()
        if e.get("event") == "daemon.start_failed" and e.get("error") == "state_disk"
    ]
    assert failed, daemon.log_path.read_text()[offset:]
    assert ("full" if fault == "full" else "read-only") in failed[-1]["message"]
    assert "df -h" in failed[-1]["hint"]
    assert db.read_bytes() == saved
    assert not [p for p in state_disk.files() if "corrupt" in p]
    if fault == "full":
        state_disk.free()
    else:
        state_disk.read_only(False)
    daemon.read_notifications()
    daemon.notifications.clear()  # wait for this start's READY=1
    daemon.start()
    for lease in leases:
        after = daemon.client().call("get_lease", lease_id=lease["lease_id"])
        assert after["state"] == "active" and after["mig_uuid"] == lease["mig_uuid"]


# -- 7. notes describe the state after the leases are restored -----------------------------------


def test_after_a_crash_restored_leases_leave_no_unexplained_note(
    daemon: DaemonProcess, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    """kill -9 with jobs running on their instances: at restart the instances have
    processes before their leases are back; once restored, they are explained."""
    daemon.extra_args += ["--set", f"backend.sim_state_file={daemon.root / 'sim-gpus.json'}"]
    daemon.start()
    client = daemon.client()
    leases = []
    for n in range(4):
        holder = subprocess.Popen(["sleep", "120"])
        cuda = subprocess.Popen(["sleep", "120"])
        sleepers += [holder, cuda]
        lease = client.lease(job_id=f"7.{n}", gpu_memory_mib=4000, wait_s=10, holder_pid=holder.pid)
        client.call("sim_attach", pid=cuda.pid, device_uuid=lease["mig_uuid"])
        leases.append(lease)
    daemon.signal(signal.SIGKILL)
    daemon.wait()
    daemon.read_notifications()
    daemon.notifications.clear()
    daemon.start()
    status = daemon.client().status()
    assert not [note for note in status["notes"] if "unexplained" in note], status["notes"]
    origins = {
        inst["lease_id"]: inst["origin"] for gpu in status["gpus"] for inst in gpu["instances"]
    }
    assert all(origins[lease["lease_id"]] == "migd" for lease in leases), origins


def test_an_unexplained_note_is_cleared_once_the_instance_is_explained(
    daemon: DaemonProcess, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    """The holder dies while migd is down, its CUDA process runs on: unexplained (kept,
    noted). When that process ends the instance is adopted, and the note goes."""
    daemon.extra_args += ["--set", f"backend.sim_state_file={daemon.root / 'sim-gpus.json'}"]
    daemon.start()
    client = daemon.client()
    holder = subprocess.Popen(["sleep", "120"])
    cuda = subprocess.Popen(["sleep", "120"])
    sleepers += [holder, cuda]
    lease = client.lease(job_id="7.9", gpu_memory_mib=4000, wait_s=10, holder_pid=holder.pid)
    client.call("sim_attach", pid=cuda.pid, device_uuid=lease["mig_uuid"])
    daemon.signal(signal.SIGKILL)
    daemon.wait()
    holder.kill()
    holder.wait()
    daemon.read_notifications()
    daemon.notifications.clear()
    daemon.start()

    def unexplained() -> list[str]:
        notes: list[str] = daemon.client().status()["notes"]
        return [note for note in notes if "unexplained" in note]

    assert unexplained()
    daemon.client().call("sim_detach", pid=cuda.pid)
    wait_for(lambda: not unexplained(), what="the note to be cleared")


# -- 2. the state disk fills up while migd runs ---------------------------------------------------


def test_a_full_state_disk_while_running_refuses_leases_cleanly_and_recovers(
    daemon: DaemonProcess, state_disk: SmallDisk, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    daemon.extra_args += ["--set", f"backend.sim_state_file={daemon.root / 'sim-gpus.json'}"]
    daemon.start()
    client = daemon.client()
    holder = subprocess.Popen(["sleep", "120"])
    sleepers.append(holder)
    kept = client.lease(job_id="2.0", gpu_memory_mib=4000, wait_s=10, holder_pid=holder.pid)
    state_disk.fill()
    # SQLite reuses the WAL's space first: lease and release until a write needs more.
    refused = None
    for n in range(1, 400):
        try:
            lease = client.lease(
                job_id=f"2.{n}", gpu_memory_mib=4000, wait_s=10, holder_pid=holder.pid
            )
        except StateDiskError as exc:
            refused = exc
            break
        client.release(lease["lease_id"])
    assert refused is not None, "the state disk never filled up"
    assert "full" in refused.message and "df -h" in refused.hint
    for n in range(3):  # and so are the next ones, cleanly
        with pytest.raises(StateDiskError):
            client.lease(job_id=f"2.x{n}", gpu_memory_mib=4000, wait_s=10, holder_pid=holder.pid)
    status = client.status()  # reads are served
    assert status["leases"]["preparing"] == 0 and status["leases"]["queued"] == 0
    assert status["leases"]["active"] == 1
    instances = [i for g in status["gpus"] for i in g["instances"]]
    assert not [i for i in instances if i["status"] != "ready"], instances
    assert status["state_disk"]["ok"] is False and "full" in status["state_disk"]["reason"]
    assert [x["lease_id"] for x in client.call("leases")["leases"]] == [kept["lease_id"]]

    state_disk.free()
    wait_for(lambda: client.status()["state_disk"]["ok"], what="recovery")
    again = client.lease(job_id="2.y", gpu_memory_mib=4000, wait_s=10, holder_pid=holder.pid)
    assert again["state"] == "active"
    client.release(again["lease_id"])
    daemon.signal(signal.SIGKILL)  # what was written meanwhile survives a crash
    daemon.wait()
    daemon.read_notifications()
    daemon.notifications.clear()
    daemon.start()
    assert daemon.client().call("get_lease", lease_id=kept["lease_id"])["state"] == "active"


# -- 6. what migd creates is never redirected ----------------------------------------------------


@pytest.mark.parametrize("setting", ["state", "run"])
def test_a_symlinked_state_or_runtime_directory_is_refused_at_start(
    daemon: DaemonProcess, setting: str
) -> None:
    real = daemon.root / f"real-{setting}"
    real.mkdir(mode=0o700)
    target = daemon.root / setting
    if setting == "run":  # the socket lives elsewhere: only the runtime directory is wrong
        daemon.extra_args += ["--socket", str(daemon.root / "sock" / "migd.sock")]
        (daemon.root / "sock").mkdir(mode=0o755)
    else:
        (daemon.root / "run").mkdir(mode=0o755)
    target.symlink_to(real)
    daemon.config_path.write_text("version = 1\n")
    daemon.start(wait_ready=False)
    assert daemon.wait() == 2  # a configuration error: systemd must not retry it
    failed = [e for e in daemon.log_events() if e.get("event") == "daemon.start_failed"]
    assert failed and "symlink" in failed[-1]["message"], daemon.log_path.read_text()
    assert f"daemon.{'state_dir' if setting == 'state' else 'runtime_dir'}" in failed[-1]["message"]
    assert list(real.iterdir()) == []  # nothing was created through the link
