"""The real ``migd`` process: ``--check-config`` checks what values mean, and every
configuration error (checked or met at start) exits 2 with one clear line and no
traceback; a node without an NVIDIA driver exits 5 (issue 24, sections 2 and 4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from migd.daemon import exit_codes
from tests.process.conftest import DaemonProcess


def migd(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIGD_")}
    return subprocess.run(
        [sys.executable, "-m", "migd", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cwd,
        env=env,
    )


def config_error(result: subprocess.CompletedProcess[str], where: str) -> str:
    """The error line for ``where``; the process exited 2 without a traceback."""
    assert result.returncode == exit_codes.CONFIG, result.stderr
    assert "Traceback" not in result.stderr and "configuration OK" not in result.stdout
    lines = [
        line
        for line in result.stderr.splitlines()
        if line.startswith(f"migd: configuration error: {where}")
    ]
    assert len(lines) == 1, result.stderr
    return lines[0]


def nvml_answers() -> bool:
    """Whether this host has an NVIDIA driver NVML can initialise."""
    probe = "import pynvml\ntry:\n pynvml.nvmlInit()\nexcept Exception:\n raise SystemExit(1)"
    return subprocess.run([sys.executable, "-c", probe], check=False, timeout=60).returncode == 0


# -- --check-config ---------------------------------------------------------------------------


def test_a_profile_no_gpu_model_has(tmp_path: Path) -> None:
    config = tmp_path / "migd.toml"
    config.write_text('version = 1\n[policy]\nprofiles = "1g.5gb,9g.99gb"\n')
    result = migd("--config", str(config), "--check-config")
    assert "'9g.99gb'" in config_error(result, "policy.profiles")
    assert "hint: profile sets: standard" in result.stderr


def test_a_user_or_group_the_host_does_not_have(tmp_path: Path) -> None:
    config = tmp_path / "migd.toml"
    config.write_text(
        'version = 1\n[api]\nlease_users = ["root", "migd-test-no-such-user"]\n'
        'lease_groups = ["migd-test-no-such-group"]\n'
    )
    result = migd("--config", str(config), "--check-config")
    assert result.returncode == exit_codes.CONFIG, result.stderr
    assert "no user 'migd-test-no-such-user'" in config_error(result, "api.lease_users")
    assert "no group 'migd-test-no-such-group'" in config_error(result, "api.lease_groups")
    assert "hint: `getent passwd migd-test-no-such-user` must find it" in result.stderr


def test_a_gpu_match_that_matches_no_simulated_gpu(tmp_path: Path) -> None:
    config = tmp_path / "migd.toml"
    config.write_text('version = 1\n[[gpu]]\nmatch = "2"\nmode = "mps"\n')
    result = migd("--config", str(config), "--simulate", "2xA100-40GB", "--check-config")
    assert "'2' matches no GPU" in config_error(result, "gpu[0].match")
    ok = migd("--config", str(config), "--simulate", "3xA100-40GB", "--check-config")
    assert ok.returncode == 0 and ok.stdout.startswith("configuration OK"), ok.stderr


def test_without_a_driver_the_gpu_checks_are_skipped_and_said_so(tmp_path: Path) -> None:
    if nvml_answers():
        pytest.skip("this host has an NVIDIA driver: the GPU checks run here")
    config = tmp_path / "migd.toml"
    config.write_text('version = 1\n[[gpu]]\nmatch = "7"\n')
    result = migd("--config", str(config), "--check-config")
    assert result.returncode == 0 and result.stdout.startswith("configuration OK"), result.stderr
    # (the startd check, where no HTCondor is installed, says it skipped too: its own line)
    [skipped] = [
        line for line in result.stderr.splitlines() if line.startswith("migd: skipped: GPU")
    ]
    assert "[[gpu]] match" in skipped and "checked against the built-in catalog only" in skipped


def test_a_missing_file_hints_at_a_command_that_makes_one(tmp_path: Path) -> None:
    result = migd("--config", "nope.toml", "--check-config", cwd=tmp_path)
    assert "file not found" in config_error(result, "nope.toml")
    assert "migd.toml.example" not in result.stderr
    assert "`migd --print-example-config > nope.toml`" in result.stderr
    # The command the hint names makes a file that checks.
    example = migd("--print-example-config")
    (tmp_path / "nope.toml").write_text(example.stdout)
    made = migd("--config", "nope.toml", "--check-config", cwd=tmp_path)
    assert made.returncode == 0 and made.stdout == "configuration OK (nope.toml)\n", made.stderr


def test_an_unknown_set_key_names_the_nearest_key() -> None:
    result = migd("--set", "polcy.queue=fifo", "--check-config")
    assert "no such setting" in config_error(result, "--set polcy.queue")
    assert "defaults" not in result.stderr
    assert "hint: did you mean policy.queue?" in result.stderr


# -- at start: one line, exit 2 (5 without a driver) -------------------------------------------


def start_failure(daemon: DaemonProcess) -> dict[str, object]:
    """The one start_failed event of a daemon that exited; no traceback in its log."""
    daemon.start(wait_ready=False)
    code = daemon.wait()
    log = daemon.log_path.read_text()
    assert "Traceback" not in log, log
    [failed] = [e for e in daemon.log_events() if e.get("event") == "daemon.start_failed"]
    failed["exit"] = code
    return failed


def test_a_profile_a_gpu_lacks_stops_the_start_with_exit_2(daemon: DaemonProcess) -> None:
    daemon.simulate = "1xA100-40GB,1xH100-80GB"
    daemon.config_text = 'version = 1\n[policy]\nprofiles = "1g.5gb,7g.40gb"\n'
    failed = start_failure(daemon)
    assert failed["exit"] == exit_codes.CONFIG
    assert failed["error"] == "config_error"
    assert "GPU 1 (H100-80GB) has no MIG profile '1g.5gb'" in str(failed["message"])
    assert "1g.10gb" in str(failed["hint"])  # the names GPU 1 does have


def test_an_unknown_simulated_model_exits_2(daemon: DaemonProcess) -> None:
    daemon.simulate = "1xZ999-1GB"
    failed = start_failure(daemon)
    assert failed["exit"] == exit_codes.CONFIG
    assert "backend.simulate" in str(failed["message"]) and failed["hint"]


def test_an_unknown_account_or_gpu_match_at_start_is_logged_not_fatal(
    daemon: DaemonProcess,
) -> None:
    # NSS (LDAP, SSSD) may not answer yet at boot, a GPU may have fallen off the bus:
    # neither must keep the other GPUs from serving; --check-config is where they are
    # errors.
    daemon.config_text = (
        'version = 1\n[api]\nadmin_users = ["root", "migd-test-no-such-user"]\n'
        '[[gpu]]\nmatch = "7"\nmode = "mps"\n'
    )
    daemon.start()
    problems = [
        str(e.get("problem")) for e in daemon.log_events() if e.get("event") == "config.check"
    ]
    assert any("no user 'migd-test-no-such-user'" in p for p in problems), problems
    assert any("gpu[0].match: '7' matches no GPU" in p for p in problems), problems
    assert len(daemon.status_json()["gpus"]) == 2


def test_a_node_without_a_driver_exits_5(daemon: DaemonProcess) -> None:
    if nvml_answers():
        pytest.skip("this host has an NVIDIA driver")
    (daemon.root / "run").mkdir(mode=0o755, exist_ok=True)
    daemon.config_path.write_text("version = 1\n")
    result = migd(
        "--config",
        str(daemon.config_path),
        "--state-dir",
        str(daemon.root / "state"),
        "--runtime-dir",
        str(daemon.root / "run"),
        "--socket",
        str(daemon.socket_path),
        "--log-format",
        "json",
    )
    assert result.returncode == exit_codes.NO_DRIVER, result.stderr
    assert "Traceback" not in result.stderr
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    [failed] = [e for e in events if e.get("event") == "daemon.start_failed"]
    assert failed["error"] == "driver_unavailable" and "nvidia-smi" in failed["hint"]
