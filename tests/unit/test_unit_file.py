"""The shipped systemd unit, read back setting by setting (issue 24 s2): bounded restarts,
no restart on a configuration error, /run/migd kept on stop, and the sandbox settings
that NVIDIA's device-node helper needs (docs/operations.md, Exit statuses). Whether
systemd accepts the file: test_daemon_parts.test_systemd_unit_verifies."""

from __future__ import annotations

import re
from pathlib import Path

from migd.daemon import exit_codes

REPO = Path(__file__).resolve().parents[2]


def unit() -> dict[str, dict[str, list[str]]]:
    """``{section: {key: [values, in order]}}``; a key may repeat (ExecStartPre=)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in (REPO / "systemd" / "migd.service").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(section: str, key: str) -> str:
    [value] = unit()[section][key]
    return value


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", value)
    assert match, value
    return int(match.group(1)) * (60 if match.group(2) == "min" else 1)


def test_restarts_are_bounded() -> None:
    assert one("Service", "Restart") == "on-failure"
    interval = seconds(one("Unit", "StartLimitIntervalSec"))
    burst = int(one("Unit", "StartLimitBurst"))
    restart_s = seconds(one("Service", "RestartSec"))
    assert interval > 0 and burst >= 1  # 0 would mean no limit at all
    # The burst is reached within the interval even with a slow start (10 s each), so a
    # node that cannot serve ends as a failed unit instead of a restart loop.
    assert burst * (restart_s + 10) < interval


def test_a_configuration_error_is_not_restarted_and_no_driver_is() -> None:
    prevented = {int(v) for v in one("Service", "RestartPreventExitStatus").split()}
    assert prevented == {exit_codes.CONFIG}
    assert exit_codes.NO_DRIVER not in prevented and exit_codes.FAILURE not in prevented


def test_the_runtime_directory_outlives_a_stop() -> None:
    assert one("Service", "RuntimeDirectory") == "migd"
    assert one("Service", "RuntimeDirectoryPreserve") == "yes"
    assert one("Service", "KillMode") == "mixed"  # SIGTERM to migd only; MPS scopes stay


def test_the_sandbox_leaves_nvidias_device_helper_working() -> None:
    service = unit()["Service"]
    # A per-user MPS server needs the setuid bit of nvidia-modprobe for MIG capability
    # nodes: NoNewPrivileges would make the kernel ignore it.
    assert service.get("NoNewPrivileges", ["no"]) == ["no"]
    # Module loading stays forbidden in the sandbox; nvidia-uvm is loaded before it,
    # with full privileges ("+"), and only where the tool exists ("-").
    assert service["ProtectKernelModules"] == ["yes"]
    [pre] = service["ExecStartPre"]
    prefix, _, command = pre.partition("/")
    assert set(prefix) == {"-", "+"} and command.startswith("usr/bin/nvidia-modprobe -u ")
    for kept in ("PrivateDevices", "DevicePolicy", "CapabilityBoundingSet", "DeviceAllow"):
        assert kept not in service, f"{kept} would stop mknod of NVIDIA device nodes"
    assert one("Service", "ProtectSystem") == "full"  # /usr, /boot, /etc: not /dev


def test_the_exit_statuses_are_documented() -> None:
    doc = (REPO / "docs" / "operations.md").read_text()
    section = doc.split("## Exit statuses", 1)[1].split("\n## ", 1)[0]
    for status in (exit_codes.OK, exit_codes.FAILURE, exit_codes.CONFIG, exit_codes.NO_DRIVER):
        assert re.search(rf"^\| {status}\b", section, re.M), status
