"""The wrapper (migd-run / migd-wrapper) as a process against a real daemon."""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from migd.backends.simulated.hardware import MIG_IDLE_USED_MIB
from migd.core.condor_shares import physical_gpu
from migd.errors import JobAdError
from migd.wrapper.jobspec import spec_from_ads
from migd.wrapper.release_hook import job_id_from_ad_text, slot_from_ad_text
from tests.process.conftest import DaemonProcess, wait_for

SIMJOB = [sys.executable, "-m", "migd.backends.simulated.cuda_job"]


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
        # Held long enough for a peak sample (the daemon samples each lease once a second),
        # so the evidence is the same however loaded the machine is: peak + what it tried.
        "--step-s",
        "2.5",
    )
    assert result.returncode == 86, result.stderr
    # It knows the node's largest partition, so it neither promises a bigger one nor asks.
    assert "nothing bigger than 40448 MiB on this node" in result.stderr
    assert "restarting on" not in result.stderr
    asked = re.search(r"request_VRAM >= (\d+) MiB", result.stderr)
    assert asked is not None, result.stderr
    assert int(asked.group(1)) >= 30 * 1024 + 15 * 1024  # the 30G it held + the 15G it tried
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
        {"Name": "slot1_3@node", "AssignedGPUs": "GPU-s03-61342749"},
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
        {"AssignedGPUs": "GPU-61342749_s3", "MigdPinToAssignedGPU": False},
    )
    assert unpinned.gpus is None  # a node without device hiding may let migd choose
    assert physical_gpu("GPU-61342749_s12") == "GPU-61342749"  # IDs before 0.2
    assert physical_gpu("GPU-s12-61342749") == "GPU-61342749"


def test_release_hook_reads_the_job_id() -> None:
    # The GlobalJobId, as the wrapper names its leases: ClusterId.ProcId repeats across
    # access points.
    ad = (
        'MyType = "Job"\nClusterId = 41\nProcId = 3\nGlobalJobId = "ap#41.3#1700000000"\n'
        'RemoteHost = "slot1_2@node"\n'
    )
    assert job_id_from_ad_text(ad) == "ap#41.3#1700000000"
    assert slot_from_ad_text(ad) == "slot1_2@node"
    assert job_id_from_ad_text("ClusterId = 41\nProcId = 3\n") == "41.3"
    assert job_id_from_ad_text("garbage") is None
    spec = spec_from_ads(["/bin/true"], {"ClusterId": 41, "ProcId": 3, "GlobalJobId":
                                         "ap#41.3#1700000000", "RequestVRAM": 100}, {})  # fmt: skip
    assert spec.job_id == "ap#41.3#1700000000"


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


# -- the audit's findings, each as a process ------------------------------------------------


def history(daemon: DaemonProcess, job_id: str) -> list[dict[str, Any]]:
    return list(daemon.client().call("history", job_id=job_id, limit=500)["history"])


def wrapper(
    daemon: DaemonProcess | None,
    tmp_path: Path,
    ad_text: str,
    *command: str,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``migd-wrapper`` as HTCondor's starter runs it: job ad, scratch dir, error file."""
    ad = tmp_path / "job.ad"
    ad.write_text(ad_text)
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o700, exist_ok=True)
    error_file = scratch / ".job_wrapper_failure"
    socket_path = daemon.socket_path if daemon else tmp_path / "nobody-home.sock"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from migd.wrapper.main import wrapper_main; "
            "sys.exit(wrapper_main(sys.argv[1:]))",
            *command,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={
            **os.environ,
            "_CONDOR_JOB_AD": str(ad),
            "_CONDOR_SCRATCH_DIR": str(scratch),
            "_CONDOR_WRAPPER_ERROR_FILE": str(error_file),
            "MIGD_API_SOCKET": str(socket_path),
            "MIGD_SAMPLE_INTERVAL_S": "0.1",
            **(env or {}),
        },
    )
    return result, error_file


def fake_chirp(tmp_path: Path, body: str) -> dict[str, str]:
    """A ``condor_chirp`` on PATH that runs ``body`` (sh); the env to use it."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    chirp = bindir / "condor_chirp"
    chirp.write_text(f"#!/bin/sh\n{body}\n")
    chirp.chmod(0o755)
    return {"PATH": f"{bindir}:{os.environ['PATH']}"}


def test_job_killed_by_sigkill_kills_the_wrapper_by_sigkill(daemon: DaemonProcess) -> None:
    # The host's OOM killer sends SIGKILL, whose handler cannot be changed.
    daemon.start()
    result = run(daemon, "--gpu-memory", "1G", "--", "sh", "-c", "kill -KILL $$")
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert "Traceback" not in result.stderr
    assert active(daemon) == []


def _unshare_works() -> str | None:
    try:
        probe = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "true"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except OSError as exc:
        return f"unshare not available: {exc}"
    if probe.returncode != 0:
        return f"unshare --pid not permitted here: {probe.stderr.strip()}"
    return None


def test_wrapper_inside_a_pid_namespace_holds_its_lease(daemon: DaemonProcess) -> None:
    why = _unshare_works()
    if why:
        pytest.skip(why)
    daemon.start()
    job = "import time; print('ready', flush=True); time.sleep(120)"
    inner = subprocess.Popen(
        [
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-m",
            "migd.wrapper.main",
            "--socket",
            str(daemon.socket_path),
            "--gpu-memory",
            "1G",
            "--job-id",
            "ns.0",
            "--",
            sys.executable,
            "-c",
            job,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert inner.stdout is not None
        assert inner.stdout.readline().strip() == "ready"
        [lease] = active(daemon)
        # The holder is the wrapper as migd's namespace names it (SO_PEERCRED), not the
        # wrapper's own getpid() (1 or 2 inside the namespace).
        holder = int(str(lease["owner_pid"]))
        assert holder > 2
        cmdline = Path(f"/proc/{holder}/cmdline").read_bytes().replace(b"\0", b" ")
        assert b"migd.wrapper.main" in cmdline, cmdline
        # So when it dies without releasing (SIGKILL), the reaper finds the lease's holder gone.
        os.killpg(inner.pid, signal.SIGKILL)
        inner.wait(10)
        wait_for(lambda: active(daemon) == [], what="the reaper to reclaim the lease")
        [ended] = [x for x in daemon.client().call("leases", all=True)["leases"]
                   if x["lease_id"] == lease["lease_id"]]  # fmt: skip
        assert ended["state"] == "reclaimed"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(inner.pid, signal.SIGKILL)
        inner.communicate()


def test_a_holder_pid_that_is_not_the_callers_is_ignored_not_refused(
    daemon: DaemonProcess,
) -> None:
    # What older wrappers sent from inside a PID namespace: a PID that means nothing here.
    daemon.start()
    gone = subprocess.Popen(["true"])
    gone.wait()
    lease = daemon.client().lease(
        job_id="old.0", gpu_memory_mib=1000, wait_s=5, holder_pid=gone.pid
    )
    assert lease["owner_pid"] == os.getpid()
    daemon.client().release(lease["lease_id"])


def test_forecast_waits_for_the_jobs_own_iterations(daemon: DaemonProcess) -> None:
    # A job that loads for a while (NVML sees memory, no iterations yet), then reports
    # allocator statistics per iteration. The time-keyed NVML samples must not eat the
    # first iterations (they did: steps below the seconds already seen were rejected).
    daemon.start()
    result = run(
        daemon,
        "--gpu-memory",
        "3G",
        "--early-restart",
        "--horizon",
        "150",
        "--job-id",
        "fc.delay",
        "--",
        *SIMJOB,
        "--start",
        "1G",
        "--grow",
        "50M",
        "--steps",
        "150",
        "--step-s",
        "0.05",
        "--start-delay",
        "2.5",
    )
    assert result.returncode == 0, result.stderr
    [fired] = [h for h in history(daemon, "fc.delay") if h["event"] == "wrapper.forecast"]
    fc = fired["data"]["forecast"]
    assert fc["series"] == "allocated"
    # every iteration up to the one it fired at is in the fit, none lost to the time series
    assert fc["n"] == fc["step"] + 1, fc
    assert fc["step"] <= 10, fc  # 5 samples + a settled fit, as without the delay


def test_oom_message_then_another_error_is_not_an_oom(daemon: DaemonProcess) -> None:
    daemon.start()
    script = textwrap.dedent("""
        import sys
        print("batch 512: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
              "2.00 GiB.", file=sys.stderr)
        print("retrying with batch 256", file=sys.stderr)
        raise ValueError("shapes (256, 3) and (512, 3) not aligned")
    """)
    result = run(daemon, "--gpu-memory", "1G", "--job-id", "val.0", "--", sys.executable, "-c",
                 script)  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "restarting" not in result.stderr
    leases = [h for h in history(daemon, "val.0") if h["event"] == "granted"]
    assert len(leases) == 1


SILENT_FULL_JOB = textwrap.dedent("""
    import os, sys, time
    from migd.client import MigdClient
    client = MigdClient(os.environ["MIGD_API_SOCKET"])
    limit = int(os.environ["MIGD_GPU_MEMORY_LIMIT_MIB"])
    client.call("sim_attach", pid=os.getpid(), device_uuid=os.environ["CUDA_VISIBLE_DEVICES"])
    client.call("sim_alloc", pid=os.getpid(), mib=int(limit * 0.985))
    time.sleep(1.5)
    client.call("sim_detach", pid=os.getpid())
    sys.exit(3)
""")


def test_weak_evidence_gets_one_bigger_retry_then_the_exit_code(daemon: DaemonProcess) -> None:
    # Memory at the limit and a silent failure, on every partition: one retry, then exit 3.
    daemon.start()
    result = run(daemon, "--gpu-memory", "3G", "--job-id", "weak.0", "--", sys.executable,
                 "-c", SILENT_FULL_JOB)  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert result.stderr.count("restarting on") == 1, result.stderr
    assert "passing its exit status through" in result.stderr
    granted = [h for h in history(daemon, "weak.0") if h["event"] == "granted"]
    assert len(granted) == 2
    assert active(daemon) == []


def test_usage_and_release_report_the_lease_peak(daemon: DaemonProcess) -> None:
    # migd samples every active MIG lease itself: the peak survives the memory being freed.
    daemon.start()
    client = daemon.client()
    lease = client.lease(job_id="peak.0", gpu_memory_mib=4000, wait_s=5)
    pid = os.getpid()
    client.call("sim_attach", pid=pid, device_uuid=lease["mig_uuid"])
    try:
        client.call("sim_alloc", pid=pid, mib=3000)

        def sampled() -> bool:  # the daemon's own sampling (once a second) saw it
            inst = [
                i
                for g in client.status()["gpus"]
                for i in g["instances"]
                if i["uuid"] == lease["mig_uuid"]
            ]
            return bool(inst) and (inst[0]["memory_used_mib"] or 0) >= 3000

        wait_for(sampled, what="the daemon to sample the allocation")
        client.call("sim_free", pid=pid, mib=3000)
        usage = client.call("usage", lease_id=lease["lease_id"])
        assert usage["device_used_mib"] < 3000 <= usage["peak_used_mib"]
    finally:
        client.call("sim_detach", pid=pid)
    released = client.release(lease["lease_id"])
    assert released["peak_used_mib"] >= 3000


def test_bad_settings_are_a_clear_error_not_a_crash(daemon: DaemonProcess, tmp_path: Path) -> None:
    daemon.start()
    bad_env = run(daemon, "--gpu-memory", "1G", "--", "true", env={"MIGD_SAMPLE_INTERVAL_S": "abc"})
    assert bad_env.returncode == 1
    assert "Traceback" not in bad_env.stderr
    assert "wrapper.sample_interval_s (MIGD_SAMPLE_INTERVAL_S)" in bad_env.stderr
    config = tmp_path / "migd.toml"
    config.write_text("version = 1\n[wrapper]\nforecast_min_samples = 2\n")
    bad_file = run(daemon, "--gpu-memory", "1G", "--", "true", env={"MIGD_CONFIG": str(config)})
    assert bad_file.returncode == 1 and "Traceback" not in bad_file.stderr
    assert f"wrapper.forecast_min_samples ({config})" in bad_file.stderr
    typo = run(
        daemon, "--gpu-memory", "1G", "--", "true", env={"MIGD_WRAPPER_SAMPLE_INTERVAL": "1"}
    )
    assert typo.returncode == 1 and "unknown wrapper setting" in typo.stderr
    assert active(daemon) == []


def test_settings_apply_and_debug_logs_the_decisions_that_do_not_fire(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    daemon.start()
    config = tmp_path / "migd.toml"
    config.write_text('version = 1\n[wrapper]\nlog_level = "debug"\n')
    result = run(
        daemon,
        "--gpu-memory",
        "3G",
        "--early-restart",
        "--horizon",
        "40",
        "--",
        *SIMJOB,
        "--start",
        "1G",
        "--grow",
        "10M",
        "--steps",
        "40",
        "--step-s",
        "0.05",
        env={"MIGD_CONFIG": str(config), "MIGD_WRAPPER_DECISION_LOG_INTERVAL_S": "0"},
    )
    assert result.returncode == 0, result.stderr
    assert "forecast:" not in result.stderr  # it fits: no restart
    lines = [x for x in result.stderr.splitlines() if "debug: forecast at step" in x]
    assert lines and any("fits:" in x and "slope" in x for x in lines), result.stderr
    assert f"settings from {config}, MIGD_SAMPLE_INTERVAL_S" in result.stderr


def test_release_hook_releases_only_its_own_jobs_lease(daemon: DaemonProcess) -> None:
    daemon.start()
    client = daemon.client()
    mine = client.lease(job_id="ap1#41.3#100", slot="slot1_1@n", gpu_memory_mib=1000, wait_s=5)
    other_schedd = client.lease(
        job_id="ap2#41.3#200", slot="slot1_2@n", gpu_memory_mib=1000, wait_s=5
    )
    plain_a = client.lease(job_id="41.3", slot="slot1_3@n", gpu_memory_mib=1000, wait_s=5)
    plain_b = client.lease(job_id="41.3", slot="slot1_4@n", gpu_memory_mib=1000, wait_s=5)

    def hook(ad: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "migd.wrapper.release_hook", "exit"],
            input=ad,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "MIGD_API_SOCKET": str(daemon.socket_path)},
        )
        assert result.returncode == 0
        return result.stderr

    hook('ClusterId = 41\nProcId = 3\nGlobalJobId = "ap1#41.3#100"\nRemoteHost = "slot1_1@n"\n')
    left = {x["lease_id"] for x in active(daemon)}
    assert mine["lease_id"] not in left
    assert {other_schedd["lease_id"], plain_a["lease_id"], plain_b["lease_id"]} <= left
    # without a GlobalJobId the slot tells two runs of "41.3" apart
    hook('ClusterId = 41\nProcId = 3\nRemoteHost = "slot1_4@n"\n')
    left = {x["lease_id"] for x in active(daemon)}
    assert left == {other_schedd["lease_id"], plain_a["lease_id"]}


def policy_chirps(lines: list[str]) -> list[str]:
    """The chirped attributes the access-point policy acts on (without the accounting
    ones: MigdPartition*, MigdRestarts, MigdPeakMB)."""
    accounting = ("MigdPartition", "MigdRestarts ", "MigdPeakMB ", "GPUsMemoryUsage ")
    return [x for x in lines if not x.removeprefix("set_job_attr ").startswith(accounting)]


BIG_OOM = [*SIMJOB, "--start", "30G", "--grow", "15G", "--steps", "2", "--step-s", "0.01"]
AD = "ClusterId = 12\nProcId = 0\nRequestGPUs = 1\nRequestVRAM = {vram}\nWantIOProxy = true\n"


def test_oom_exit_marks_the_job_through_chirp(daemon: DaemonProcess, tmp_path: Path) -> None:
    daemon.start()
    calls = tmp_path / "chirp.log"
    env = fake_chirp(tmp_path, f'echo "$@" >> {calls}')
    # 30 GiB held long enough to be sampled, then 15 GiB more fails on the node's
    # largest partition: the evidence says it needs both, which is what it asks for.
    held = [*SIMJOB, "--start", "30G", "--grow", "15G", "--steps", "2", "--step-s", "1.5"]
    result, error_file = wrapper(daemon, tmp_path, AD.format(vram=30000), *held, env=env)
    assert result.returncode == 86, result.stderr
    assert not error_file.exists()
    lines = calls.read_text().splitlines()
    # what it held (condor_q / condor_history show it), and the most it used
    assert lines[:4] == [
        'set_job_attr MigdPartitionProfile "7g.40gb"',
        "set_job_attr MigdPartitionMB 40448",
        'set_job_attr MigdPartitionMode "mig"',
        "set_job_attr MigdRestarts 0",
    ]
    [peak] = [x for x in lines if x.startswith("set_job_attr MigdPeakMB ")]
    assert int(peak.split()[-1]) >= 30 * 1024
    # HTCondor's own attribute gets the same peak
    assert f"set_job_attr GPUsMemoryUsage {peak.split()[-1]}" in lines
    chirped = policy_chirps(lines)
    assert chirped == [
        f"set_job_attr RequestVRAM {45 * 1024 + MIG_IDLE_USED_MIB}",
        "set_job_attr MigdLastVRAM 40448",  # what it ran out of, for the hold reason
        "set_job_attr MigdOomExits 1",
        "set_job_attr MigdOomExit true",  # this 86 is migd's, not the job's own
    ]
    # The rerun clears the marker (its own exit 86 would otherwise look like migd's), and
    # a run that started resets the count of starts migd failed.
    again, _ = wrapper(
        daemon,
        tmp_path,
        AD.format(vram=1000) + "MigdOomExit = true\nMigdOomExits = 1\nMigdStartFailures = 2\n",
        "true",
        env=env,
    )
    assert again.returncode == 0, again.stderr
    assert policy_chirps(calls.read_text().splitlines())[4:] == [
        "set_job_attr MigdOomExit false",
        "set_job_attr MigdStartFailures 0",
    ]


def test_chirp_that_hangs_does_not_crash_the_wrapper(daemon: DaemonProcess, tmp_path: Path) -> None:
    daemon.start()
    env = {**fake_chirp(tmp_path, "sleep 30"), "MIGD_WRAPPER_CHIRP_TIMEOUT_S": "0.5"}
    result, error_file = wrapper(daemon, tmp_path, AD.format(vram=30000), *BIG_OOM, env=env)
    assert result.returncode == 86, result.stderr  # was 1 (TimeoutExpired escaped)
    assert "did not answer within 0.5 s" in result.stderr
    # (the job's own fake traceback is there; none of the wrapper's)
    assert "TimeoutExpired" not in result.stderr and "migd/" not in result.stderr
    assert not error_file.exists() and active(daemon) == []


def test_mps_unavailable_is_reported_and_the_job_requeued(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    daemon.start()
    calls = tmp_path / "chirp.log"
    env = fake_chirp(tmp_path, f'echo "$@" >> {calls}')
    script = (
        "import sys; print('RuntimeError: CUDA error: all CUDA-capable devices are busy or "
        "unavailable', file=sys.stderr); sys.exit(1)"
    )
    result, error_file = wrapper(
        daemon, tmp_path, AD.format(vram=1000) + "MigdStartFailures = 2\n",
        sys.executable, "-c", script, env=env,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "could not use its MPS share" in error_file.read_text()
    assert "wrapper.mps_client_error" in [h["event"] for h in history(daemon, "12.0")]
    # counted as a start migd failed, for the access point's loop breaker (the grant had
    # reset the count of failures in a row)
    chirped = policy_chirps(calls.read_text().splitlines())
    assert chirped[:2] == ["set_job_attr MigdStartFailures 0", "set_job_attr MigdStartFailures 3"]
    assert chirped[2].startswith('set_job_attr MigdStartFailureReason "migd: the job could not')
    assert len(chirped) == 3
    assert active(daemon) == []


def test_a_job_that_cannot_be_executed_fails_like_in_a_shell(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    daemon.start()
    result, error_file = wrapper(daemon, tmp_path, AD.format(vram=1000), str(tmp_path / "nope"))
    assert result.returncode == 127, result.stderr
    assert "cannot start the job" in result.stderr
    assert not error_file.exists()  # the job's fault: not requeued as if migd had failed
    assert active(daemon) == []


def test_stop_while_waiting_for_a_partition_reraises_the_signal(daemon: DaemonProcess) -> None:
    daemon.start()
    client = daemon.client()
    held = [client.lease(job_id=f"full.{i}", gpu_memory_mib=40000, wait_s=5) for i in range(2)]
    waiting = subprocess.Popen(
        [sys.executable, "-m", "migd.wrapper.main", "--socket", str(daemon.socket_path),
         "--gpu-memory", "1G", "--wait", "60", "--", "true"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: daemon.client().status()["queue"], what="the request to queue")
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(20) == -signal.SIGTERM
        assert "stopped by SIGTERM" in waiting.communicate()[1]
        wait_for(lambda: not daemon.client().status()["queue"], what="the queue to empty")
    finally:
        waiting.kill()
        waiting.communicate()
        for lease in held:
            client.release(lease["lease_id"])


def test_oom_evidence_beyond_the_node_tries_the_largest_partition_first(
    daemon: DaemonProcess,
) -> None:
    # 3 GiB held for a second (so the peak is known), then a 38 GiB allocation fails on
    # 1g.5gb: peak + failed allocation (41 GiB) is more than the node's largest partition.
    # The wrapper tries that largest one rather than giving up, then gives up with 86.
    daemon.start()
    result = run(daemon, "--gpu-memory", "3G", "--job-id", "cap.0", "--", *SIMJOB, "--start",
                 "3G", "--grow", "38G", "--steps", "1", "--start-delay", "1.0")  # fmt: skip
    assert result.returncode == 86, result.stderr
    # the peak NVML shows includes what an idle MIG device already uses
    wants = 3 * 1024 + 38 * 1024 + MIG_IDLE_USED_MIB
    assert "restarting on the largest partition here (40448 MiB" in result.stderr
    assert f"it wants {wants} MiB" in result.stderr
    assert "7g.40gb (40448 MiB" in result.stderr
    assert f"request_VRAM >= {wants} MiB" in result.stderr  # what it needs, for a bigger node
    assert active(daemon) == []


def test_a_gpu_lost_under_the_job_stops_it_and_requeues_it_with_the_reason(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    # The test drives the admin-only sim_xid op as itself.
    daemon.config_text = f"version = 1\n[api]\nadmin_users = ['{getpass.getuser()}']\n"
    daemon.start()
    calls = tmp_path / "chirp.log"
    ad = tmp_path / "job.ad"
    ad.write_text(AD.format(vram=5000) + "MigdStartFailures = 2\nMigdGpuLosses = 1\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o700)
    error_file = scratch / ".job_wrapper_failure"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from migd.wrapper.main import wrapper_main; "
            "sys.exit(wrapper_main(sys.argv[1:]))",
            "sleep",
            "300",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            **fake_chirp(tmp_path, f'echo "$@" >> {calls}'),
            "_CONDOR_JOB_AD": str(ad),
            "_CONDOR_SCRATCH_DIR": str(scratch),
            "_CONDOR_WRAPPER_ERROR_FILE": str(error_file),
            "MIGD_API_SOCKET": str(daemon.socket_path),
            "MIGD_SAMPLE_INTERVAL_S": "0.1",
        },
    )
    try:
        [lease] = wait_for(lambda: active(daemon), what="the job's lease")
        wait_for(lambda: active(daemon)[0]["state"] == "active", what="the lease active")
        daemon.client().call("sim_xid", gpu=lease["gpu"], xid=79)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The error file: HTCondor's starter evicts the job back to Idle (not held) with this
    # line as its VacateReason, naming the XID and the GPU. Exit 85 (1 before lease end
    # reasons): a lease migd took back, which the access point requeues should the file
    # be missed.
    assert proc.returncode == 85, stderr
    reason = error_file.read_text()
    assert reason.startswith("migd: GPU lost: XID 79 (GPU has fallen off the bus)"), reason
    assert f"GPU {lease['gpu_uuid']}" in reason and "healthy GPU" in reason
    assert "stopping the job" in stderr
    # Counted as a GPU loss, not as a start migd failed (no loop-breaker hold for it).
    chirped = policy_chirps(calls.read_text().splitlines())
    assert chirped[0] == "set_job_attr MigdStartFailures 0"
    # One chirp: the lease loss (typed), and the GPU loss under its older names.
    attrs = dict(x.removeprefix("set_job_attr ").split(" ", 1) for x in chirped[1:])
    assert attrs.pop("MigdGpuLosses") == "2" and attrs.pop("MigdLeaseLosses") == "1"
    assert attrs.pop("MigdLeaseLost") == "true"
    assert attrs.pop("MigdLeaseEndReason") == '"gpu_lost"'
    assert attrs.pop("MigdGpuLostReason").startswith('"GPU lost: XID 79')
    assert attrs.pop("MigdLeaseLostReason").startswith('"GPU lost: XID 79')
    assert attrs == {}
    # The job was stopped (no sleep left behind) and its lease released.
    assert active(daemon) == []
    assert "released" in [h["event"].split(".")[-1] for h in history(daemon, "12.0")]
