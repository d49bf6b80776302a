"""``migd --check-config`` names the file it read (not "defaults" when it read one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _check(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "migd", "--check-config", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return result.stdout.strip()


def test_check_config_names_the_file_it_read(tmp_path: Path) -> None:
    config = tmp_path / "migd.toml"
    config.write_text("version = 1\n[policy]\nqueue = 'fifo'\n")
    assert _check("--config", str(config)) == f"configuration OK ({config})"


def test_check_config_without_a_file_says_which_one_is_missing() -> None:
    out = _check()
    # /etc/migd/migd.toml on this host may or may not exist; either way the path is named
    assert out.startswith("configuration OK (") and "/etc/migd/migd.toml" in out
    if not Path("/etc/migd/migd.toml").exists():
        assert out == "configuration OK (defaults, no /etc/migd/migd.toml)"


def test_check_config_warns_about_a_startd_that_bypasses_migd(tmp_path: Path) -> None:
    """The startd's knobs (issue 24 s3) are checked too, as warnings (HTCondor's
    configuration, not migd's): here a stand-in condor_config_val with a site's
    START = True and condor_gpu_discovery's inventory."""
    tool = tmp_path / "condor_config_val"
    tool.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        "  USER_JOB_WRAPPER) echo /usr/bin/migd-wrapper;;\n"
        "  STARTER_JOB_HOOK_KEYWORD) echo MIGD;;\n"
        "  MIGD_HOOK_JOB_EXIT) echo /usr/bin/migd-release-hook;;\n"
        "  MACHINE_RESOURCE_INVENTORY_GPUs) echo /usr/libexec/condor/condor_gpu_discovery;;\n"
        "  START) echo True;;\n"
        '  *) echo "Not defined: $1" >&2; exit 1;;\n'
        "esac\n"
    )
    tool.chmod(0o755)
    config = tmp_path / "migd.toml"
    config.write_text(f'version = 1\n[htcondor]\nconfig_val_command = ["{tool}"]\n')
    result = subprocess.run(
        [sys.executable, "-m", "migd", "--check-config", "--config", str(config)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "startd bypasses migd" in line]
    assert [w.split("bypasses migd: ")[1].split(" = ")[0] for w in warnings] == [
        "MACHINE_RESOURCE_INVENTORY_GPUs",
        "START",
    ], result.stderr
    missing = tmp_path / "none.toml"
    missing.write_text(f'version = 1\n[htcondor]\nconfig_val_command = ["{tmp_path}/nope"]\n')
    result = subprocess.run(
        [sys.executable, "-m", "migd", "--check-config", "--config", str(missing)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0
    assert f"migd: skipped: the startd's configuration: cannot run {tmp_path}/nope" in result.stderr
