"""The .deb packages: what is in them, and the lifecycle an admin goes through.

Contents are read with ``dpkg-deb``; the lifecycle (install, a running migd holding a
lease through an upgrade and a restart, remove, purge) runs inside the trixie chroot with
a stand-in ``systemctl`` that records what the maintainer scripts ask systemd to do (the
chroot has no systemd), while the test does what systemd would do with the restart.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from condor_pool import CondorChroot

pytestmark = [pytest.mark.slow, pytest.mark.htcondor]

REPO = Path(__file__).resolve().parents[2]
# dpkg runs maintainer scripts with its own PATH (no /usr/local): the stand-in goes where
# systemd's would be (the chroot has no systemd)
FAKE_SYSTEMCTL = "/usr/bin/systemctl"
SYSTEMCTL_LOG = "/var/log/fake-systemctl.log"


def _deb(debs: Path, name: str) -> Path:
    [deb] = sorted(debs.glob(f"{name}_*.deb"))
    return deb


def _dpkg_deb(*args: str | Path) -> str:
    return subprocess.run(
        ["dpkg-deb", *map(str, args)], capture_output=True, text=True, check=True
    ).stdout


def _listing(deb: Path) -> dict[str, str]:
    """path -> 'mode-string [-> target]' from dpkg-deb -c."""
    out = {}
    for line in _dpkg_deb("-c", deb).splitlines():
        fields = line.split(None, 5)
        name = fields[5]
        path, _, target = name.partition(" -> ")
        out[path.removeprefix(".").rstrip("/") or "/"] = fields[0] + (
            f" -> {target}" if target else ""
        )
    return out


def test_the_daemon_package_holds_a_venv_commands_unit_and_conffile(debs: Path) -> None:
    deb = _deb(debs, "migd")
    depends = _dpkg_deb("-f", deb, "Depends")
    # the venv's compiled wheels are for the build's python3 (trixie: 3.13)
    assert "python3 (>= 3.13), python3 (<< 3.14)" in depends, depends
    files = _listing(deb)
    assert _dpkg_deb("-f", deb, "Architecture").strip() == "amd64"
    for cmd in ("migd", "migctl", "migd-wrapper", "migd-run", "migd-release-hook"):
        assert files[f"/opt/migd/bin/{cmd}"].startswith("-rwxr-xr-x")
        assert files[f"/usr/bin/{cmd}"] == f"lrwxrwxrwx -> ../../opt/migd/bin/{cmd}"
    assert files["/opt/migd/bin/python"] == "lrwxrwxrwx -> /usr/bin/python3"
    assert files["/usr/lib/systemd/system/migd.service"].startswith("-rw-r--r--")
    # job users' wrappers read [wrapper] from it: world-readable
    assert files["/etc/migd/migd.toml"].startswith("-rw-r--r--")
    assert files["/var/lib/migd"].startswith("drwx------")
    assert any(p.startswith("/opt/migd/lib/python3.13/site-packages/migd/") for p in files)
    assert not any("__pycache__" in p and not p.endswith(".pyc") for p in files if "." in p[-5:])
    assert not any(p.startswith("/usr/share/condor") for p in files)


def test_the_venv_names_only_its_final_paths(debs: Path, tmp_path: Path) -> None:
    subprocess.run(["dpkg-deb", "-x", _deb(debs, "migd"), tmp_path], check=True)
    venv = tmp_path / "opt/migd"
    texts = [p for p in (venv / "bin").iterdir() if p.is_file() and not p.is_symlink()]
    texts.append(venv / "pyvenv.cfg")
    for path in texts:
        text = path.read_text(errors="replace")
        assert "migd-pkg." not in text, f"{path} names the staging directory"
    shebang = (venv / "bin/migd").read_text().splitlines()[0]
    assert shebang == "#!/opt/migd/bin/python"
    cfg = (venv / "pyvenv.cfg").read_text()
    assert "home = /usr/bin" in cfg
    toml = (tmp_path / "etc/migd/migd.toml").read_text()
    assert 'kind = "nvml"' in toml and "[wrapper]" in toml  # migd --print-example-config


def test_conffiles_and_maintainer_scripts(debs: Path, tmp_path: Path) -> None:
    deb = _deb(debs, "migd")
    subprocess.run(["dpkg-deb", "-e", deb, tmp_path], check=True)
    assert (tmp_path / "conffiles").read_text().split() == ["/etc/migd/migd.toml"]
    for script in ("postinst", "prerm", "postrm"):
        path = tmp_path / script
        assert path.stat().st_mode & 0o111, script
        subprocess.run(["sh", "-n", path], check=True)


@pytest.mark.parametrize(
    ("name", "config"),
    [("migd-ep", "10-migd-execute.config"), ("migd-ap", "20-migd-access-point.config")],
)
def test_htcondor_drop_ins_are_in_share_condor_config_d(
    debs: Path, tmp_path: Path, name: str, config: str
) -> None:
    deb = _deb(debs, name)
    assert _dpkg_deb("-f", deb, "Architecture").strip() == "all"
    depends = _dpkg_deb("-f", deb, "Depends")
    assert "condor | htcondor" in depends
    if name == "migd-ep":
        version = _dpkg_deb("-f", deb, "Version").strip()
        assert f"migd (= {version})" in depends
    subprocess.run(["dpkg-deb", "-x", deb, tmp_path], check=True)
    shipped = tmp_path / "usr/share/condor/config.d" / config
    assert shipped.read_text() == (REPO / "condor_config" / config).read_text()
    # not a conffile: admins override in /etc/condor/config.d, read after it
    assert "conffiles" not in _dpkg_deb("-I", deb)


# --------------------------------------------------------------------------- #
# Lifecycle in the chroot
# --------------------------------------------------------------------------- #
FAKE = """#!/bin/sh
echo "$*" >> __LOG__
exit 0
""".replace("__LOG__", SYSTEMCTL_LOG)


def _repack(deb: Path, revision: str, out: Path) -> Path:
    """The same package with another Debian revision: an upgrade without a rebuild."""
    tree = out / f"tree-{revision}"
    subprocess.run(["dpkg-deb", "-R", deb, tree], check=True)
    control = tree / "DEBIAN/control"
    version = _dpkg_deb("-f", deb, "Version").strip()
    new = version.rsplit("-", 1)[0] + f"-{revision}"
    control.write_text(control.read_text().replace(f"Version: {version}", f"Version: {new}"))
    target = out / deb.name.replace(version, new)
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-Zgzip", "-z1", "-b", tree, target],
        check=True,
        capture_output=True,
    )
    return target


def _systemctl_calls(ch: CondorChroot) -> list[str]:
    path = ch.path(SYSTEMCTL_LOG)
    calls = path.read_text().splitlines() if path.exists() else []
    path.unlink(missing_ok=True)
    return calls


def _apt(ch: CondorChroot, *args: str) -> None:
    ch.run(
        ["apt-get", "-y", "-q", "--no-install-recommends", *args],
        env={"DEBIAN_FRONTEND": "noninteractive"},
        cwd="/tmp/migd-debs",
        timeout=300,
    )


def _start_migd(ch: CondorChroot, log: Path) -> subprocess.Popen[bytes]:
    # the simulated GPU keeps its MIG layout across a restart in a file, as a real one does
    sim = ["--simulate", "1xA100-40GB", "--set", "backend.sim_state_file=/var/lib/migd/sim.json"]
    argv = ch.command(["migd", "--config", "/etc/migd/migd.toml", *sim])
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=out, start_new_session=True)
    ch.protected_pids.add(proc.pid)
    deadline = time.monotonic() + 60
    while ch.run(["migctl", "status"], check=False).returncode != 0:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    return proc


def _leases(ch: CondorChroot) -> list[dict[str, object]]:
    return list(json.loads(ch.run(["migctl", "leases", "--json"]).stdout)["leases"])


def test_install_upgrade_remove_purge_keep_leases_and_state(
    trixie_chroot: CondorChroot, debs: Path, tmp_path: Path
) -> None:
    ch = trixie_chroot
    ch.run(["dpkg", "--purge", "migd-ep", "migd-ap", "migd"], check=False)
    ch.run(["rm", "-rf", "/tmp/migd-debs", "/var/lib/migd", "/run/migd"])
    assert not ch.path(FAKE_SYSTEMCTL).exists(), "the chroot has systemd: no stand-in needed"
    ch.write_file(FAKE_SYSTEMCTL, FAKE, mode=0o755)
    ch.path("run/systemd/system").mkdir(parents=True, exist_ok=True)
    v1 = _deb(debs, "migd")
    v2 = _repack(v1, "99", tmp_path)
    for deb in (v1, v2):
        ch.copy_in(deb, f"/tmp/migd-debs/{deb.name}")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        t0 = time.monotonic()
        _apt(ch, "install", f"./{v1.name}")
        print(f"apt-get install ./{v1.name}: {time.monotonic() - t0:.1f}s")
        # a first install tells systemd about the unit and starts nothing
        assert _systemctl_calls(ch) == ["daemon-reload"]
        assert ch.run(["migd", "--config", "/etc/migd/migd.toml", "--check-config"]).returncode == 0

        # the admin edits the one file, starts migd, a job takes a lease
        conf = ch.read_file("/etc/migd/migd.toml").replace(
            "idle_timeout_s = 300.0", "idle_timeout_s = 301.0"
        )
        ch.write_file("/etc/migd/migd.toml", conf)
        log = ch.path("/var/log/migd-lifecycle.log")
        procs.append(_start_migd(ch, log))
        job = subprocess.Popen(
            ch.command(["migd-run", "--gpu-memory", "3G", "--", "sleep", "300"]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        procs.append(job)
        ch.protected_pids.add(job.pid)
        deadline = time.monotonic() + 60
        while not [x for x in _leases(ch) if x["state"] == "active"]:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        [lease] = _leases(ch)

        # upgrade: never stopped, restarted once the new files are in place
        _apt(ch, "install", f"./{v2.name}")
        assert _systemctl_calls(ch) == ["daemon-reload", "try-restart migd.service"]
        assert "idle_timeout_s = 301.0" in ch.read_file("/etc/migd/migd.toml")
        assert procs[0].poll() is None  # dpkg did not touch the running daemon
        # ... what systemd's try-restart does: SIGTERM (migd drains), start again
        procs[0].terminate()
        procs[0].wait(60)
        procs[0] = _start_migd(ch, log)
        [after] = _leases(ch)
        assert after["lease_id"] == lease["lease_id"] and after["state"] == "active"

        # remove: stops migd, keeps the configuration and the state
        job.terminate()
        job.wait(30)
        _apt(ch, "remove", "migd")
        assert _systemctl_calls(ch) == ["stop migd.service", "daemon-reload"]
        assert ch.path("/etc/migd/migd.toml").is_file()
        assert ch.path("/var/lib/migd").is_dir() and any(ch.path("/var/lib/migd").iterdir())
        procs[0].terminate()
        procs[0].wait(60)

        # purge: configuration and state gone, the unit disabled
        _apt(ch, "purge", "migd")
        assert _systemctl_calls(ch) == ["disable migd.service", "daemon-reload"]
        assert not ch.path("/etc/migd").exists()
        assert not ch.path("/var/lib/migd").exists()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            ch.protected_pids.discard(proc.pid)
        ch.run(["dpkg", "--purge", "migd"], check=False)
        ch.run(["rm", "-rf", "/run/systemd", FAKE_SYSTEMCTL, SYSTEMCTL_LOG, "/tmp/migd-debs"])
