"""The .rpm packages, built with rpmbuild on this machine and inspected with rpm -qp.

The scriptlets are also run: extracted with ``rpm -qp --qf``, with ``systemctl`` replaced
by a recorder and the "is systemd running" test forced true, called with the argument rpm
passes on a first install (1), an upgrade (1 for %postun of the old package) and an erase
(0); and by rpm itself, installing the three packages into an empty root with
``rpm --root`` (a /bin/sh, /dev/null and a recording systemctl in it) and erasing them.
What that leaves unverified: migd running there (EL9's python3.11 and HTCondor's
python3-condor are not on this machine: ``--nodeps``), and an upgrade between two builds.
"""

from __future__ import annotations

import os
import shutil
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
        assert f"/usr/bin/{cmd}" in files
    assert "/usr/lib/migd/migd/__init__.py" in files
    # byte-compiled at build time (EL ships byte-code): nothing writes into /usr/lib/migd
    assert any(f.startswith("/usr/lib/migd/migd/__pycache__/__init__.cpython-") for f in files)
    # no pip, setuptools or PyPI htcondor (HTCondor's python3-condor provides the bindings)
    for banned in ("pip", "setuptools", "htcondor", "classad", "_distutils_hack"):
        assert not any(f.startswith(f"/usr/lib/migd/{banned}") for f in files), banned
    assert not any(f.startswith("/opt") for f in files)
    assert "/usr/share/man/man8/migd.8.gz" in files
    assert "/usr/share/doc/migd/contrib/prometheus/migd-alerts.yml" in files
    assert _rpm("-qp", "--qf", "%{RELEASE}", rpm).endswith(".el9")
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
    assert "python3-condor" in requires, requires
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


def _empty_root(root: Path) -> Path:
    """A root with just enough for rpm's scriptlets: /bin/sh (with its libraries), /dev/null,
    a systemctl that records its arguments, and /run/systemd/system (systemd "running")."""
    sh = Path(os.path.realpath("/bin/sh"))
    libs = subprocess.run(["ldd", sh], capture_output=True, text=True, check=True).stdout
    for lib in [p for line in libs.splitlines() for p in line.split() if p.startswith("/")]:
        (root / lib.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, root / lib.lstrip("/"))
    (root / "bin").mkdir(exist_ok=True)
    shutil.copy2(sh, root / "bin/sh")
    for d in ("usr/bin", "var/tmp", "tmp", "dev", "run/systemd/system"):
        (root / d).mkdir(parents=True, exist_ok=True)
    subprocess.run(["mknod", "-m", "666", root / "dev/null", "c", "1", "3"], check=True)
    systemctl = root / "usr/bin/systemctl"
    systemctl.write_text('#!/bin/sh\necho "$*" >> /tmp/systemctl.log\n')
    systemctl.chmod(0o755)
    _rpm("--root", root, "--initdb")
    return root / "tmp/systemctl.log"


def _calls(log: Path) -> list[str]:
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return calls


def test_rpm_installs_into_an_empty_root_running_its_scriptlets(rpms: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("rpm --root into a fresh root (with /dev/null made by mknod) needs root")
    root = tmp_path / "root"
    log = _empty_root(root)
    packages = [_one(rpms, p) for p in ("migd-[0-9]*.rpm", "migd-ep-*.rpm", "migd-ap-*.rpm")]
    # --nodeps: python3.11, python3-condor and condor are EL9's and HTCondor's, not here
    _rpm("--root", root, "-i", "--nodeps", *packages)
    assert _calls(log) == ["daemon-reload"]  # %post: a first install starts nothing
    assert sorted(_rpm("--root", root, "-qa", "--qf", "%{NAME}\n").split()) == [
        "migd",
        "migd-ap",
        "migd-ep",
    ]
    assert (root / "var/lib/migd").stat().st_mode & 0o777 == 0o700
    assert (root / "etc/migd/migd.toml").stat().st_mode & 0o777 == 0o644
    script = (root / "usr/bin/migd-wrapper").read_text()
    assert script.startswith("#!/usr/bin/python3.")
    assert 'sys.path.append("/usr/lib64/python3.9/site-packages")' in script
    assert (root / "usr/share/condor/config.d/10-migd-execute.config").is_file()
    # every file as packaged (modes, digests); only the dependencies left out are missing
    verify = subprocess.run(
        ["rpm", "--root", root, "-V", "migd", "migd-ep", "migd-ap"],
        capture_output=True,
        text=True,
        check=False,
    )
    problems = [
        line
        for line in verify.stdout.splitlines()
        if line.strip() and not line.startswith(("Unsatisfied", "\t"))
    ]
    assert problems == [], verify.stdout

    # an admin edits the configuration; erase keeps it as .rpmsave and stops migd
    (root / "etc/migd/migd.toml").write_text("version = 1\n# edited\n")
    _rpm("--root", root, "-e", "migd-ep", "migd-ap", "migd")
    assert _calls(log) == ["--no-reload disable --now migd.service", "daemon-reload"]
    assert _rpm("--root", root, "-qa").strip() == ""
    assert not (root / "usr/lib/migd").exists()
    assert (root / "etc/migd/migd.toml.rpmsave").read_text() == "version = 1\n# edited\n"
