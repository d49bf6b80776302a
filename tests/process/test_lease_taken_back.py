"""A lease migd takes back stops its job (issue 21 §3): the real daemon, the real wrapper,
one test per path the job did not ask for (an admin's ``migctl release``, lease expiry,
the instance gone across a restart, the GPU lost). Each job ignores its first signal, so
every test shows the signal delivered, then the SIGKILL after the grace period, then the
wrapper's exit 85 with migd's reason. ``migctl reset`` never ends a lease (it destroys
idle instances only): its test shows the job running on."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from migd.wrapper.runner import LEASE_LOST_EXIT_CODE
from tests.process.conftest import DaemonProcess, wait_for

# A job that records each signal it gets and ignores it: only SIGKILL ends it.
STUBBORN = (
    'echo $$ > "$JOB_DIR/pid"; '
    'for s in TERM INT USR1; do trap "echo $s >> \\"$JOB_DIR/signals\\"" $s; done; '
    "while :; do sleep 0.05; done"
)
AD = "ClusterId = 21\nProcId = 0\nRequestGPUs = 1\nRequestVRAM = 4000\nWantIOProxy = true\n"
GRACE_S = "1"
LONG_S = 60.0  # generous limits: a loaded 2-core machine is slow, a hang is not


@dataclass
class Job:
    proc: subprocess.Popen[str]
    dir: Path
    chirps: Path
    error_file: Path

    def signals(self) -> list[str]:
        path = self.dir / "signals"
        return path.read_text().split() if path.exists() else []

    def pid(self) -> int:
        return int((self.dir / "pid").read_text())

    def finish(self) -> tuple[int, str]:
        _, stderr = self.proc.communicate(timeout=LONG_S)
        return self.proc.returncode, stderr

    def chirped(self) -> dict[str, str]:
        out = {}
        for line in self.chirps.read_text().splitlines() if self.chirps.exists() else []:
            _, name, value = line.split(" ", 2)
            out[name] = value
        return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for this purpose (its parent, the wrapper, may not have reaped it).
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


@contextlib.contextmanager
def wrapped_job(
    daemon: DaemonProcess, tmp_path: Path, ad_extra: str = "", grace: str = GRACE_S
) -> Iterator[Job]:
    """The stubborn job under ``migd-wrapper`` as HTCondor's starter runs it (job ad,
    scratch dir, error file, a recording condor_chirp), its lease active."""
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    ad = tmp_path / "job.ad"
    ad.write_text(AD + ad_extra)
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o700)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    chirps = tmp_path / "chirp.log"
    chirp = bindir / "condor_chirp"
    chirp.write_text(f'#!/bin/sh\necho "$@" >> {chirps}\n')
    chirp.chmod(0o755)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from migd.wrapper.main import wrapper_main; "
            "sys.exit(wrapper_main(sys.argv[1:]))",
            "sh",
            "-c",
            STUBBORN,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "PATH": f"{bindir}:{os.environ['PATH']}",
            "JOB_DIR": str(job_dir),
            "_CONDOR_JOB_AD": str(ad),
            "_CONDOR_SCRATCH_DIR": str(scratch),
            "_CONDOR_WRAPPER_ERROR_FILE": str(scratch / ".job_wrapper_failure"),
            "MIGD_API_SOCKET": str(daemon.socket_path),
            "MIGD_WRAPPER_SAMPLE_INTERVAL_S": "0.1",
            "MIGD_WRAPPER_TERM_GRACE_S": grace,
        },
    )
    job = Job(proc, job_dir, chirps, scratch / ".job_wrapper_failure")
    try:
        wait_for((job_dir / "pid").exists, LONG_S, "the job to start")
        yield job
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        with contextlib.suppress(OSError, ValueError):
            os.killpg(job.pid(), signal.SIGKILL)


def the_lease(daemon: DaemonProcess) -> dict[str, Any]:
    [lease] = wait_for(
        lambda: [x for x in daemon.client().call("leases")["leases"] if x["state"] == "active"],
        LONG_S,
        "the job's lease to be active",
    )
    return dict(lease)


def assert_stopped(
    job: Job, lease: dict[str, Any], reason: str, words: str, kill_sig: str = "TERM"
) -> str:
    """The job got its kill signal, ignored it, was SIGKILLed after the grace period; the
    wrapper exited 85 with migd's reason in the error file and the job ad."""
    code, stderr = job.finish()
    assert code == LEASE_LOST_EXIT_CODE, stderr
    assert job.signals() == [kill_sig], stderr  # delivered once, ignored...
    assert not alive(job.pid()), "the job outlived the grace period"  # ...then SIGKILL
    assert f"stopping the job (SIG{kill_sig}, SIGKILL after {GRACE_S} s)" in stderr, stderr
    line = job.error_file.read_text().strip()
    assert line.startswith(f"migd: {words}"), line
    assert f"(lease {lease['lease_id']}, GPU {lease['gpu_uuid']})" in line, line
    assert "goes back to the queue" in line, line
    chirped = job.chirped()
    assert chirped["MigdLeaseLost"] == "true"
    assert chirped["MigdLeaseLosses"] == "1"
    assert chirped["MigdLeaseEndReason"] == f'"{reason}"'
    assert chirped["MigdLeaseLostReason"].startswith(f'"{words}')
    # Not a start migd failed (the loop breaker holds only those).
    assert "MigdStartFailures" not in chirped
    return line


def final(daemon: DaemonProcess, lease_id: str) -> dict[str, Any]:
    view: dict[str, Any] = daemon.client().call("get_lease", lease_id=lease_id)
    return view


def test_an_admins_release_stops_the_job_with_its_kill_sig(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    daemon.start()
    with wrapped_job(daemon, tmp_path, 'KillSig = "SIGINT"\n') as job:
        lease = the_lease(daemon)
        released = daemon.migctl("release", lease["lease_id"], "--reason", "GPU needed")
        assert released.returncode == 0, released.stderr
        assert_stopped(
            job, lease, "admin_release", "an administrator released the job's GPU partition",
            kill_sig="INT",
        )  # fmt: skip
    view = final(daemon, lease["lease_id"])
    assert view["state"] == "released" and view["end_reason"] == "admin_release"
    assert view["reason"] == "GPU needed"


def test_lease_expiry_stops_the_job(daemon: DaemonProcess, tmp_path: Path) -> None:
    # The wrapper sends no heartbeats: with a heartbeat timeout its lease expires.
    daemon.extra_args += ["--set", "reaper.heartbeat_timeout_s=1"]
    daemon.start()
    with wrapped_job(daemon, tmp_path) as job:
        lease = the_lease(daemon)
        line = assert_stopped(job, lease, "expired", "migd reclaimed the GPU partition")
        assert "lease expired" in line and "no heartbeat" in line
    view = final(daemon, lease["lease_id"])
    assert view["state"] == "reclaimed" and view["end_reason"] == "expired"


def test_the_instance_gone_across_a_restart_stops_the_job(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    state_file = daemon.root / "sim-gpus.json"
    daemon.extra_args += ["--set", f"backend.sim_state_file={state_file}"]
    daemon.start()
    with wrapped_job(daemon, tmp_path) as job:
        lease = the_lease(daemon)
        daemon.signal(signal.SIGKILL)
        assert daemon.wait() == -signal.SIGKILL
        # While migd is down its MIG instance goes (as `nvidia-smi mig -dci/-dgi` would).
        saved = json.loads(state_file.read_text())
        gpu = saved["gpus"][lease["gpu"]]
        gpu["instances"] = [
            gi
            for gi in gpu["instances"]
            if all(ci.get("uuid") != lease["mig_uuid"] for ci in gi["cis"])
        ]
        state_file.write_text(json.dumps(saved))
        daemon.read_notifications()
        daemon.notifications.clear()
        daemon.start()
        line = assert_stopped(
            job, lease, "instance_gone", "the job's GPU partition disappeared from the GPU"
        )
        assert "its MIG instance is gone" in line  # migd's reason
    view = final(daemon, lease["lease_id"])
    assert view["state"] == "reclaimed" and view["end_reason"] == "instance_gone"


def test_a_lost_gpu_stops_the_job(daemon: DaemonProcess, tmp_path: Path) -> None:
    # The test drives the admin-only sim_xid op as itself.
    daemon.config_text = f"version = 1\n[api]\nadmin_users = ['{getpass.getuser()}']\n"
    daemon.start()
    with wrapped_job(daemon, tmp_path) as job:
        lease = the_lease(daemon)
        daemon.client().call("sim_xid", gpu=lease["gpu"], xid=79)
        assert_stopped(job, lease, "gpu_lost", "GPU lost: XID 79 (GPU has fallen off the bus)")
        assert job.chirped()["MigdGpuLosses"] == "1"  # the older attribute too
    view = final(daemon, lease["lease_id"])
    assert view["state"] == "released" and view["end_reason"] == "gpu_lost"


def test_a_job_that_stops_on_its_signal_is_not_killed(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    daemon.start()
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    # Exits at the first SIGTERM; the grace period is long, so a SIGKILL would show.
    proc = subprocess.Popen(
        [sys.executable, "-m", "migd.wrapper.main", "--socket", str(daemon.socket_path),
         "--gpu-memory", "4G", "--job-id", "polite.0", "--", "sh", "-c",
         f'trap "echo TERM > {job_dir}/signals; exit 0" TERM; echo $$ > {job_dir}/pid; '
         "while :; do sleep 0.05; done"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "MIGD_WRAPPER_SAMPLE_INTERVAL_S": "0.1",
             "MIGD_WRAPPER_TERM_GRACE_S": "300"},
    )  # fmt: skip
    try:
        lease = the_lease(daemon)
        wait_for((job_dir / "pid").exists, LONG_S, "the job to start")
        daemon.client().release(lease["lease_id"], reason="taken back")
        _, stderr = proc.communicate(timeout=LONG_S)  # far less than the 300 s grace
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == LEASE_LOST_EXIT_CODE, stderr
    assert (job_dir / "signals").read_text().split() == ["TERM"]
    assert "an administrator released the job's GPU partition (taken back)" in stderr


def test_an_admin_reset_leaves_a_running_job_alone(daemon: DaemonProcess, tmp_path: Path) -> None:
    daemon.config_text = f"version = 1\n[api]\nadmin_users = ['{getpass.getuser()}']\n"
    daemon.start()
    with wrapped_job(daemon, tmp_path) as job:
        lease = the_lease(daemon)
        reset = daemon.migctl("reset", str(lease["gpu"]), "--json")
        assert reset.returncode == 0, reset.stderr
        kept = json.loads(reset.stdout)["kept_busy"]
        assert any(lease["profile"] in x for x in kept), kept
        # The lease is untouched (nothing for the wrapper to see) and the job runs on.
        assert job.proc.poll() is None and job.signals() == []
        assert final(daemon, lease["lease_id"])["end_reason"] is None
        # The wrapper was watching all along: an admin's release then stops the job.
        daemon.client().release(lease["lease_id"])
        code, _ = job.finish()
        assert code == LEASE_LOST_EXIT_CODE and job.signals() == ["TERM"]


def test_the_jobs_own_release_is_not_a_loss(daemon: DaemonProcess) -> None:
    daemon.start()
    result = subprocess.run(
        [sys.executable, "-m", "migd.wrapper.main", "--socket", str(daemon.socket_path),
         "--gpu-memory", "4G", "--job-id", "own.0", "--", "sh", "-c", "exit 3"],
        capture_output=True, text=True, timeout=LONG_S, check=False,
    )  # fmt: skip
    assert result.returncode == 3, result.stderr  # the job's own status, not 85
    [ended] = [
        x for x in daemon.client().call("leases", all=True)["leases"] if x["job_id"] == "own.0"
    ]
    assert ended["end_reason"] == "released"
