"""The wrapper (migd-run / migd-wrapper) as a process against a real daemon."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from migd.errors import JobAdError
from migd.wrapper.jobspec import physical_gpu, spec_from_ads
from migd.wrapper.release_hook import job_id_from_ad_text
from tests.process.conftest import DaemonProcess, wait_for

SIMJOB = [sys.executable, "-m", "migd.testing.simjob"]


def run(
    daemon: DaemonProcess, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "migd.wrapper.main", "--socket", str(daemon.socket_path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={
            **os.environ,
            "MIGD_API_SOCKET": str(daemon.socket_path),
            "MIGD_SAMPLE_INTERVAL_S": "0.1",
            **(env or {}),
        },
    )


def active(daemon: DaemonProcess) -> list[dict[str, object]]:
    return [x for x in daemon.client().call("leases")["leases"] if x["state"] != "queued"]


def test_oom_restarts_on_the_next_profile_and_completes(daemon: DaemonProcess) -> None:
    daemon.start()
    result = run(
        daemon,
        "--gpu-memory",
        "3G",
        "--job-id",
        "oom.0",
        "--",
        *SIMJOB,
        "--start",
        "3G",
        "--grow",
        "1G",
        "--steps",
        "4",
        "--step-s",
        "0.01",
    )
    assert result.returncode == 0, result.stderr
    assert "CUDA out of memory" in result.stderr
    assert "restarting on a bigger partition" in result.stderr
    # first 1g.5gb, then a 10 GB profile (2g.10gb when 1g.10gb would strand a compute slice)
    assert "1g.5gb (4864 MiB" in result.stderr and "(9984 MiB" in result.stderr
    assert "simjob: done, peak 7168 MiB" in result.stdout
    assert active(daemon) == []
    events = [h["event"] for h in daemon.client().call("history", job_id="oom.0")["history"]]
    assert "wrapper.oom" in events


def test_restart_limit_then_documented_exit_code(daemon: DaemonProcess) -> None:
    daemon.start()
    result = run(
        daemon,
        "--gpu-memory",
        "3G",
        "--max-restarts",
        "1",
        "--job-id",
        "lim.0",
        "--",
        *SIMJOB,
        "--start",
        "3G",
        "--grow",
        "6G",
        "--steps",
        "3",
        "--step-s",
        "0.01",
    )
    assert result.returncode == 86, result.stderr
    assert "no restarts left" in result.stderr
    assert active(daemon) == []


def test_nothing_bigger_on_this_node_exits_86(daemon: DaemonProcess) -> None:
    daemon.start()
    result = run(
        daemon,
        "--gpu-memory",
        "30G",
        "--job-id",
        "big.0",
        "--",
        *SIMJOB,
        "--start",
        "30G",
        "--grow",
        "15G",
        "--steps",
        "2",
        "--step-s",
        "0.01",
    )
    assert result.returncode == 86, result.stderr
    assert "no partition of >=" in result.stderr
    assert active(daemon) == []


def test_forecast_restarts_early(daemon: DaemonProcess) -> None:
    daemon.start()
    result = run(
        daemon,
        "--gpu-memory",
        "3G",
        "--early-restart",
        "--horizon",
        "150",
        "--job-id",
        "fc.0",
        "--",
        *SIMJOB,
        "--start",
        "1G",
        "--grow",
        "50M",
        "--steps",
        "150",
        "--step-s",
        "0.03",
    )
    assert result.returncode == 0, result.stderr
    assert "forecast:" in result.stderr and "CUDA out of memory" not in result.stderr
    events = [h["event"] for h in daemon.client().call("history", job_id="fc.0")["history"]]
    assert "wrapper.forecast" in events


def test_exit_codes_and_a_false_oom_alarm_pass_through(daemon: DaemonProcess) -> None:
    daemon.start()
    noisy = (
        "import sys; print('CUDA out of memory (just a log line)', file=sys.stderr); sys.exit(0)"
    )
    ok = run(daemon, "--gpu-memory", "1G", "--", sys.executable, "-c", noisy)
    assert ok.returncode == 0 and "restarting" not in ok.stderr
    three = run(daemon, "--gpu-memory", "1G", "--", sys.executable, "-c", "raise SystemExit(3)")
    assert three.returncode == 3 and "restarting" not in three.stderr
    assert active(daemon) == []


def test_job_killed_by_a_signal_kills_the_wrapper_the_same_way(daemon: DaemonProcess) -> None:
    daemon.start()
    result = run(daemon, "--gpu-memory", "1G", "--", "sh", "-c", "kill -USR1 $$")
    assert result.returncode == -signal.SIGUSR1
    assert active(daemon) == []


def test_signals_are_forwarded_and_the_lease_released(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    daemon.start()
    marker = tmp_path / "got"
    script = textwrap.dedent(f"""
        import signal, sys, time
        def stop(sig, frame):
            open({str(marker)!r}, "a").write(signal.Signals(sig).name + "\\n")
            if sig == signal.SIGTERM:
                sys.exit(7)
        for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
            signal.signal(s, stop)
        print("ready", flush=True)
        while True:
            time.sleep(0.1)
    """)
    wrapper = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "migd.wrapper.main",
            "--socket",
            str(daemon.socket_path),
            "--gpu-memory",
            "1G",
            "--",
            sys.executable,
            "-c",
            script,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wrapper.stdout is not None
        assert wrapper.stdout.readline().strip() == "ready"
        wait_for(lambda: active(daemon), what="the lease")
        for sig in (signal.SIGUSR1, signal.SIGHUP):
            wrapper.send_signal(sig)
            wait_for(
                lambda s=sig: marker.exists() and signal.Signals(s).name in marker.read_text(),
                what=f"{sig} to reach the job",
            )
        wrapper.send_signal(signal.SIGTERM)
        assert wrapper.wait(30) == 7
        assert marker.read_text().split() == ["SIGUSR1", "SIGHUP", "SIGTERM"]
        assert active(daemon) == []
    finally:
        wrapper.kill()
        wrapper.communicate()


def test_wrapper_error_file_when_the_daemon_is_down(tmp_path: Path) -> None:
    ad = tmp_path / "job.ad"
    ad.write_text("ClusterId = 12\nProcId = 0\nRequestGPUs = 1\nRequestVRAM = 4000\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o700)
    error_file = scratch / ".job_wrapper_failure"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from migd.wrapper.main import wrapper_main; "
            "sys.exit(wrapper_main(sys.argv[1:]))",
            "/bin/true",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={
            **os.environ,
            "_CONDOR_JOB_AD": str(ad),
            "_CONDOR_SCRATCH_DIR": str(scratch),
            "_CONDOR_WRAPPER_ERROR_FILE": str(error_file),
            "MIGD_API_SOCKET": str(tmp_path / "nobody-home.sock"),
        },
    )
    assert result.returncode == 1
    line = error_file.read_text()
    assert line.count("\n") == 1 and "migd is not available" in line
    assert scratch.stat().st_mode & 0o777 == 0o711  # so HTCondor's starter can see the file


def test_non_gpu_jobs_pass_straight_through(tmp_path: Path) -> None:
    ad = tmp_path / "job.ad"
    ad.write_text("ClusterId = 13\nProcId = 0\nRequestCpus = 1\n")
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from migd.wrapper.main import wrapper_main; "
            "sys.exit(wrapper_main(sys.argv[1:]))",
            "sh",
            "-c",
            "echo plain; exit 4",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={
            **os.environ,
            "_CONDOR_JOB_AD": str(ad),
            "MIGD_API_SOCKET": str(tmp_path / "nobody-home.sock"),
        },
    )
    assert result.returncode == 4 and result.stdout.strip() == "plain"


@pytest.mark.parametrize(
    ("job_ad", "machine_ad", "message"),
    [
        ({"ClusterId": 1, "ProcId": 0, "RequestGPUs": 1}, {}, "request_VRAM"),
        ({"ClusterId": 1, "ProcId": 0, "RequestVRAM": 100, "MigdMode": "turbo"}, {}, "MigdMode"),
        ({"ProcId": 0, "RequestVRAM": 100}, {}, "ClusterId"),
        ({"ClusterId": 1, "ProcId": 0, "RequestVRAM": "lots"}, {}, "not a number"),
    ],
)
def test_unusable_ads_are_clear_errors_not_guesses(
    job_ad: dict[str, object], machine_ad: dict[str, object], message: str
) -> None:
    with pytest.raises(JobAdError, match=message):
        spec_from_ads(["/bin/true"], job_ad, machine_ad)


def test_job_ad_fields_and_gpu_shares() -> None:
    spec = spec_from_ads(
        ["/bin/true"],
        {
            "ClusterId": 5,
            "ProcId": 2,
            "RequestGPUs": 1,
            "RequestVRAM": 9000,
            "MigdMode": "MIG",
            "MigdEarlyRestart": True,
            "MigdHorizon": 300,
            "WantIOProxy": True,
        },
        {"Name": "slot1_3@node", "AssignedGPUs": "GPU-61342749_s3", "MigdPinToAssignedGPU": True},
    )
    assert (spec.job_id, spec.memory_mib, spec.mode, spec.slot) == (
        "5.2",
        9000,
        "mig",
        "slot1_3@node",
    )
    assert spec.gpus == ("GPU-61342749",) and spec.early_restart and spec.horizon == 300
    assert spec.want_chirp
    unpinned = spec_from_ads(
        ["/bin/true"],
        {"ClusterId": 5, "ProcId": 2, "RequestVRAM": 9000},
        {"AssignedGPUs": "GPU-61342749_s3", "VRAM": 9000},
    )
    assert unpinned.gpus is None  # migd chooses the GPU unless the node pins it
    assert physical_gpu("GPU-61342749_s12") == "GPU-61342749"


def test_release_hook_reads_the_job_id() -> None:
    ad = 'MyType = "Job"\nClusterId = 41\nProcId = 3\nGlobalJobId = "ap#41.3#1700000000"\n'
    assert job_id_from_ad_text(ad) == "41.3"
    assert job_id_from_ad_text('GlobalJobId = "ap#41.3#17"\n') == "ap:41.3:17"
    assert job_id_from_ad_text("garbage") is None


def test_release_hook_releases_the_jobs_leases(daemon: DaemonProcess) -> None:
    daemon.start()
    lease = daemon.client().lease(job_id="77.0", gpu_memory_mib=1000, wait_s=5)
    result = subprocess.run(
        [sys.executable, "-m", "migd.wrapper.release_hook", "evict"],
        input="ClusterId = 77\nProcId = 0\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "MIGD_API_SOCKET": str(daemon.socket_path)},
    )
    assert result.returncode == 0 and lease["lease_id"] in result.stderr
    assert active(daemon) == []
    # and it never fails the starter, even with migd gone
    daemon.stop()
    again = subprocess.run(
        [sys.executable, "-m", "migd.wrapper.release_hook", "exit"],
        input="ClusterId = 77\nProcId = 0\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "MIGD_API_SOCKET": str(daemon.socket_path)},
    )
    assert again.returncode == 0
