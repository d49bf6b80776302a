"""The .rpm packages, built with rpmbuild on this machine and inspected with rpm -qp.

The scriptlets are also run: extracted with ``rpm -qp --qf``, with ``systemctl`` replaced
by a recorder and the "is systemd running" test forced true, called with the argument rpm
passes on a first install (1), an upgrade (1 for %postun of the old package) and an erase
(0).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _rpm(*args: str | Path) -> str:
    return subprocess.run(
        ["rpm", *map(str, args)], capture_output=True, text=True, check=True
    ).stdout


def _one(rpms: Path, pattern: str) -> Path:
    [found] = sorted(rpms.glob(pattern))
    return found


def test_the_daemon_rpm_files_configfiles_and_requires(rpms: Path) -> None:
    rpm = _one(rpms, "migd-[0-9]*.rpm")
    files = set(_rpm("-qlp", rpm).split())
    for cmd in ("migd", "migctl", "migd-wrapper", "migd-run", "migd-release-hook"):
        assert f"/opt/migd/bin/{cmd}" in files and f"/usr/bin/{cmd}" in files
    assert "/usr/lib/systemd/system/migd.service" in files
    assert not any(f.startswith("/usr/share/condor") for f in files)
    assert _rpm("-qp", "--configfiles", rpm).split() == ["/etc/migd/migd.toml"]
    # %config(noreplace): rpm keeps an edited file and writes the new one as .rpmnew
    flags = _rpm("-qp", "--qf", "[%{FILENAMES} %{FILEFLAGS:fflags}\n]", rpm)
    assert "/etc/migd/migd.toml cn" in flags.splitlines()
    modes = _rpm("-qp", "--qf", "[%{FILENAMES} %{FILEMODES:perms}\n]", rpm).splitlines()
    assert "/var/lib/migd drwx------" in modes
    requires = _rpm("-qp", "--requires", rpm).split("\n")
    assert any(r.startswith("python3.") for r in requires), requires
    # no automatic requires from the venv's shared objects (they come with their wheels)
    assert not any(".so" in r for r in requires), requires


def test_ep_and_ap_rpms_carry_the_htcondor_drop_ins(rpms: Path) -> None:
    ep = _one(rpms, "migd-ep-*.noarch.rpm")
    ap = _one(rpms, "migd-ap-*.noarch.rpm")
    assert "/usr/share/condor/config.d/10-migd-execute.config" in _rpm("-qlp", ep).split()
    assert "/usr/share/condor/config.d/20-migd-access-point.config" in _rpm("-qlp", ap).split()
    version = _rpm("-qp", "--qf", "%{VERSION}-%{RELEASE}", ep)
    assert f"migd = {version}" in _rpm("-qp", "--requires", ep)
    assert "condor" in _rpm("-qp", "--requires", ap).split()


def _run_scriptlet(rpm: Path, tag: str, arg: int, tmp_path: Path) -> list[str]:
    body = _rpm("-qp", "--qf", f"%{{{tag}}}", rpm)
    assert body and body != "(none)", tag
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    log = tmp_path / "systemctl.log"
    log.unlink(missing_ok=True)
    (fake / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (fake / "systemctl").chmod(0o755)
    script = body.replace("[ -d /run/systemd/system ]", "true")
    subprocess.run(
        ["sh", "-e", "-c", script, tag, str(arg)],
        env={"PATH": f"{fake}:/usr/bin:/bin"},
        check=True,
    )
    return log.read_text().splitlines() if log.exists() else []


def test_scriptlets_restart_on_upgrade_and_stop_only_on_erase(rpms: Path, tmp_path: Path) -> None:
    rpm = _one(rpms, "migd-[0-9]*.rpm")
    assert _run_scriptlet(rpm, "POSTIN", 1, tmp_path) == ["daemon-reload"]
    # upgrade: the old package's %preun/%postun run with 1
    assert _run_scriptlet(rpm, "PREUN", 1, tmp_path) == []
    assert _run_scriptlet(rpm, "POSTUN", 1, tmp_path) == [
        "daemon-reload",
        "try-restart migd.service",
    ]
    # erase
    assert _run_scriptlet(rpm, "PREUN", 0, tmp_path) == ["--no-reload disable --now migd.service"]
    assert _run_scriptlet(rpm, "POSTUN", 0, tmp_path) == ["daemon-reload"]
