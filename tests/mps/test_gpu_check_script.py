"""scripts/mps_gpu_check.sh and scripts/mps_migd_check.py, without a GPU.

The shell script is checked for syntax (and with shellcheck where installed), its
dry run for the refusals it must make, and a whole run against the stand-in control
daemon and a stand-in nvidia-smi for its clean-up. The migd part runs MpsManager's
real code against the fake daemon with a client that fails like PyTorch does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import wait_for

from .conftest import pid_alive

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "mps_gpu_check.sh"
MIGD_CHECK = REPO / "scripts" / "mps_migd_check.py"
GPU = "GPU-0a1b2c3d-0000-4000-8000-0000000000aa"

# A client like mps_gpu_check.sh's, for the fake: it learns its limit from the MPS server
# (through the pipe directory) and fails with PyTorch's message past it.
FAKE_CLIENT = """
import json, os, sys
from migd.backends.simulated.mps_control import connect_client
label, target = sys.argv[1], int(sys.argv[2])
got = connect_client(os.environ["CUDA_MPS_PIPE_DIRECTORY"], os.getpid(), os.getuid(),
                     os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", ""))
limit = None if got is None else got[1]
report = {"label": label, "limit_seen_mib": limit}
if limit is not None and target > limit:
    print(f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 "
          f"has a total capacity of {limit / 1024:.2f} GiB", file=sys.stderr)
    report.update(outcome="oom", allocated_mib=limit)
    print(json.dumps(report))
    sys.exit(1)
report.update(outcome="allocated", allocated_mib=target)
print(json.dumps(report))
"""


def stand_in_nvidia_smi(bin_dir: Path, *, mig: str) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        f'  *mig.mode.current*) echo "{mig}";;\n'
        f'  *query-gpu=uuid*) echo "{GPU}";;\n'
        f'  -L) echo "GPU 0: Test (UUID: {GPU})";;\n'
        '  *) echo "stand-in nvidia-smi";;\n'
        "esac\n"
    )
    smi.chmod(0o755)


def script_env(bin_dir: Path, fake_binary: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{fake_binary.parent}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
    }


def test_the_script_is_valid_bash_and_shellcheck_clean() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed")
    result = subprocess.run(
        ["shellcheck", str(SCRIPT)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout


def test_dry_run_refuses_a_parent_gpu_with_mig_enabled(tmp_path: Path, fake_binary: Path) -> None:
    bin_dir = tmp_path / "bin"
    stand_in_nvidia_smi(bin_dir, mig="Enabled")
    run = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=script_env(bin_dir, fake_binary),
        timeout=60,
        check=True,
    )
    assert f"GPU {GPU} has MIG enabled" in run.stdout and "ready to run" not in run.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    stand_in_nvidia_smi(bin_dir, mig="Disabled")
    run = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        capture_output=True,
        text=True,
        env=script_env(bin_dir, fake_binary),
        timeout=60,
        check=True,
    )
    assert "ready to run" in run.stdout and "9. migd's MpsManager" in run.stdout
    # Without --dry-run, the refusal is an error.
    stand_in_nvidia_smi(bin_dir, mig="Enabled")
    refused = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=script_env(bin_dir, fake_binary),
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2 and "MIG enabled" in refused.stderr


@pytest.mark.slow  # real daemons, clients and the check script
def test_a_whole_run_against_stand_ins_leaves_no_daemon_and_writes_result_json(
    tmp_path: Path, fake_binary: Path
) -> None:
    bin_dir = tmp_path / "bin"
    stand_in_nvidia_smi(bin_dir, mig="Disabled")
    env = script_env(bin_dir, fake_binary)
    env["PYTHONPATH"] = str(REPO)
    env["CAP_CLIENTS"] = "3"  # step 10's light clients: few, on a shared 2-core machine
    run = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    (run_dir,) = (tmp_path / "out").iterdir()
    summary = (run_dir / "summary.txt").read_text()
    assert "Cannot find MPS control daemon process" in summary
    assert "An instance of this daemon is already running" in summary
    result = json.loads((run_dir / "result.json").read_text())
    labels = [c["label"] for c in result["clients"]]
    assert result["device"] == GPU and len(labels) == 14, labels
    assert {"cap_1", "cap_2", "cap_3"} <= set(labels)
    # Step 8 waits for the client's mark (it is connected), not a fixed sleep.
    assert "sleep 3" not in SCRIPT.read_text()
    assert "[client cap: " in summary or "client cap" in summary
    # Issue 13's additions: two clients of one job, a fault, a quit with a live client.
    assert {"same_job_a", "same_job_b", "fault", "after_fault", "live_at_quit"} <= set(labels)
    assert "quit returned after" in summary
    assert result["migd"]["job_env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1024M"
    assert result["migd"]["stopped"] is True
    # No daemon is left: neither the script's nor migd's.
    pid_line = next(line for line in summary.splitlines() if "stop: quit daemon" in line)
    assert not pid_alive(int(pid_line.split("stop: quit daemon ")[1].split()[0]))
    work = Path(summary.split("pipe dir: ", 1)[1].split()[0]).parent
    assert work.name.startswith("migd-mps.") and not work.exists()  # removed once stopped


@pytest.mark.slow  # real daemons, clients and the check script
def test_migd_check_classifies_the_clients_oom_and_stops_its_daemon(
    tmp_path: Path, fake_binary: Path, short_dir: Path
) -> None:
    client = tmp_path / "client.py"
    client.write_text(FAKE_CLIENT)
    out = tmp_path / "migd_check.json"
    run = subprocess.run(
        [
            sys.executable,
            str(MIGD_CHECK),
            *("--binary", str(fake_binary), "--device", GPU, "--limit-mib", "1024"),
            *("--out", str(out), "--runtime-dir", str(short_dir), "--"),
            sys.executable,
            str(client),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    share, dropped, mb = result["clients"]
    assert share["client"]["limit_seen_mib"] == 1024 and share["exit_code"] == 1
    assert (
        share["verdict"]["kind"] == "strong" and "CUDA out of memory" in share["verdict"]["matched"]
    )
    # Without the variable, the server's limit (the share's) still holds.
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in dropped["env"]
    assert dropped["client"]["limit_seen_mib"] == 1024 and dropped["verdict"]["kind"] == "strong"
    assert mb["client"]["limit_seen_mib"] == 512 and mb["verdict"]["kind"] == "strong"
    assert result["summary"]["migd_handles_the_oom"] is True
    assert result["stopped"] is True and not pid_alive(result["daemon"]["pid"])


GPU_CHECKS = REPO / "scripts" / "gpu_checks.sh"


@pytest.mark.slow  # every check script, end to end, on the simulated backend
@pytest.mark.parametrize(
    ("description", "mig_says"),
    [
        ("1xA100-40GB:mig=off", "STAY UNVERIFIED"),
        ("1xA100-40GB", "[mig_calibrate exit 0]"),
    ],
)
def test_gpu_checks_runs_every_step_on_the_simulated_backend(
    tmp_path: Path, description: str, mig_says: str
) -> None:
    """``MIGD_SIMULATE=`` runs gpu_checks.sh without a GPU: the probe and the calibration on
    the simulated node, the MPS check against the stand-in daemon; nothing is left running."""
    out = tmp_path / "out"
    env = {
        **os.environ,
        "MIGD_SIMULATE": description,
        "PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
        "CAP_CLIENTS": "2",
    }
    run = subprocess.run(
        ["bash", str(GPU_CHECKS), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    log = (out / "checks.log").read_text()
    assert "SIMULATED: " + description in log and "[gpu_probe exit 0]" in log
    assert mig_says in log
    assert json.loads((out / "probe.json").read_text())["gpus"]
    # Step 6 never installs a unit in a simulated run (nor where systemd is not PID 1, as
    # in the containers the suite runs in); it says so, and writes what it would install.
    assert "[systemd_unit_check (" in log and "exit 0]" in log.split("[systemd_unit_check")[1]
    assert (out / "systemd" / "result.txt").read_text().startswith("skipped: ")
    dropin = (out / "systemd" / "unit" / "migd-gpucheck.conf").read_text()
    assert f"ExecStart={sys.executable} -m migd --config" in dropin
    assert (out / "systemd" / "unit" / "migd-gpucheck.service").read_text() == (
        REPO / "systemd" / "migd.service"
    ).read_text()
    if "mig=off" in description:
        assert "[mig_calibrate exit 3]" in log and "[mps_gpu_check exit 0]" in log
        (mps_run,) = (out / "mps").iterdir()
        assert json.loads((mps_run / "result.json").read_text())["migd"]["stopped"] is True
    else:
        record = json.loads((out / "calibrate.json").read_text())
        assert record["status"] == "complete" and record["left_on_gpu"] == []
        assert (out / "calibrate.json.steps.jsonl").read_text().count('"step": "placement"')
        assert record["in_use"]["nvml_error"] == "NVML_ERROR_IN_USE"  # the busy destroy
        # MPS inside a MIG device the check made and destroyed, and migd in MIG mode
        assert "[mps_gpu_check in a MIG device exit 0]" in log
        assert "[gpu_probe with an instance exit 0]" in log
        assert "[gpu_daemon_check (mig) exit 0]" in log
    if "mig=off" in description:
        assert "[gpu_daemon_check (mps) exit 0]" in log
    # Every job of the daemon check ended well, hw.3 across migd's restart included: on
    # the simulated backend its MIG instance survives only in the state file, as real
    # GPUs keep theirs (the script once left that out, and hw.3 lost its instance).
    for job in ("hw.1", "hw.2", "hw.3"):
        assert f"[{job} exit 0]" in log, job
    assert "no nv-hostengine (DCGM) running" in log
    assert log.rstrip().count("no MPS daemon left running") >= 2


SYSTEMD_CHECK = REPO / "scripts" / "systemd_unit_check.sh"


def test_the_systemd_unit_check_installs_nothing_where_it_cannot_and_says_why(
    tmp_path: Path,
) -> None:
    """A simulated run (or one where systemd is not PID 1) records that it skipped and why,
    and writes the unit and drop-in it would install; it needs no root and no systemd."""
    out = tmp_path / "out"
    unit_dir = tmp_path / "units"
    env = {
        **os.environ,
        "MIGD_SIMULATE": "1xV100-32GB",
        "PYTHON": sys.executable,
        "MIGD_UNIT_DIR": str(unit_dir),
    }
    run = subprocess.run(
        ["bash", str(SYSTEMD_CHECK), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = (out / "result.txt").read_text()
    assert result.startswith("skipped: ")
    assert "systemd is not PID 1" in result or "simulated run installs no unit" in result
    assert "SKIPPED: " in (out / "systemd_check.log").read_text()
    assert not unit_dir.exists()
    dropin = (out / "unit" / "migd-gpucheck.conf").read_text()
    assert "ExecStart=\n" in dropin and f"ExecStart={sys.executable} -m migd" in dropin
    assert "RuntimeDirectory=migd-gpucheck" in dropin and "StateDirectory=migd-gpucheck" in dropin


FAKE_SYSTEMCTL = """#!/bin/bash
# Records every call; "start" snapshots the installed unit and leaves an MPS scope record
# as migd would, then hangs while FAKE_START_BLOCKS is set (longer than the test waits).
echo "$*" >>"$FAKE_LOG"
case "$1" in
  start)
    cp -r "$MIGD_UNIT_DIR" "$FAKE_SNAPSHOT"
    mkdir -p "$MIGD_SYSTEMD_CHECK_PREFIX/run/migd-gpucheck/mps/dev"
    echo '{"scope_unit": "migd-mps-gpu-0a1b-abc123"}' \\
      >"$MIGD_SYSTEMD_CHECK_PREFIX/run/migd-gpucheck/mps/dev/migd-mps.json"
    if [[ -n ${FAKE_START_BLOCKS:-} ]]; then touch "$FAKE_LOG.blocked"; exec sleep 600; fi
    ;;
  show) printf 'Result=success\\nExecMainStatus=0\\n';;
  is-active) echo inactive; exit 3;;
esac
exit 0
"""


def fake_systemd(tmp_path: Path) -> tuple[dict[str, str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text(FAKE_SYSTEMCTL)
    (bin_dir / "journalctl").write_text("#!/bin/sh\necho no journal here\n")
    for tool in ("systemctl", "journalctl"):
        (bin_dir / tool).chmod(0o755)
    log = tmp_path / "systemctl.log"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "MIGD_UNIT_DIR": str(tmp_path / "units"),
        "MIGD_SYSTEMD_CHECK_PREFIX": str(tmp_path / "root"),
        "MIGD_SYSTEMD_CHECK_ASSUME": "1",
        "FAKE_LOG": str(log),
        "FAKE_SNAPSHOT": str(tmp_path / "installed"),
    }
    env.pop("MIGD_SIMULATE", None)
    return env, log


def assert_cleaned_up(tmp_path: Path, calls: list[str]) -> None:
    assert "stop migd-gpucheck.service" in calls
    assert "stop migd-mps-gpu-0a1b-abc123" in calls  # the MPS scope migd left
    assert calls[-1] == "is-active migd-gpucheck.service" and "daemon-reload" in calls[-3:]
    assert not (tmp_path / "units" / "migd-gpucheck.service").exists()
    assert not (tmp_path / "units" / "migd-gpucheck.service.d").exists()
    assert not (tmp_path / "root" / "run" / "migd-gpucheck-conf").exists()
    assert not (tmp_path / "root" / "var" / "lib" / "migd-gpucheck").exists()


def test_the_systemd_unit_check_installs_the_shipped_unit_and_removes_it_after(
    tmp_path: Path,
) -> None:
    """With systemd assumed (a recording systemctl): the shipped unit and the drop-in are
    what gets installed, and everything is stopped and removed at the end."""
    env, log = fake_systemd(tmp_path)
    out = tmp_path / "out"
    run = subprocess.run(
        ["bash", str(SYSTEMD_CHECK), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    installed = tmp_path / "installed"
    assert (installed / "migd-gpucheck.service").read_text() == (
        REPO / "systemd" / "migd.service"
    ).read_text()
    dropin = (installed / "migd-gpucheck.service.d" / "tree.conf").read_text()
    assert f"ExecStart={sys.executable} -m migd --config" in dropin
    # No migd really started (systemctl is a recorder), so the job's lease fails.
    assert (out / "result.txt").read_text().startswith("failed: job exit"), run.stdout
    calls = log.read_text().splitlines()
    assert calls[:3] == [
        "is-active --quiet migd.service",
        "daemon-reload",
        "start migd-gpucheck.service",
    ]
    assert_cleaned_up(tmp_path, calls)


def test_the_systemd_unit_check_cleans_up_on_sigterm(tmp_path: Path) -> None:
    """SIGTERM to its process group (as `timeout` sends it) while the unit's start hangs:
    the clean-up runs at once, not when the start gives up, stopping the unit and the MPS
    scope and removing every installed file."""
    env, log = fake_systemd(tmp_path)
    env["FAKE_START_BLOCKS"] = "1"
    proc = subprocess.Popen(
        ["bash", str(SYSTEMD_CHECK), str(tmp_path / "out")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(
            lambda: Path(f"{log}.blocked").exists(),
            timeout_s=120,
            what="the check to block in systemctl start",
        )
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 143
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert_cleaned_up(tmp_path, log.read_text().splitlines())
