"""A broken configuration never changes who may do what (issue 23, section 2): SIGHUP
with an empty, cut-short or non-UTF-8 file keeps the running configuration whole and
says why; at start the same files exit 2 with a message, never a traceback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from migd.errors import NotAuthorized
from tests.process.conftest import DaemonProcess, wait_for
from tests.process.test_daemon_process import OTHER_UID, as_user

GOOD = (
    'version = 1\n[policy]\nqueue = "size"\n'
    f'[api]\nlease_users = ["root", "condor", "{OTHER_UID}"]\n'
)
BROKEN = {
    "empty": b"",
    "comments only": b"# migd configuration\n\n",
    "cut short at a line": GOOD.split("[api]", maxsplit=1)[0].encode(),  # parses: [api] is gone
    "cut short mid-line": GOOD.encode()[: GOOD.index("condor") + 3],
    "non-UTF-8 byte": GOOD.replace("size", "si\udcffze").encode("utf-8", "surrogateescape"),
}


def lease_as_other_uid(daemon: DaemonProcess) -> str:
    """``ok`` or the error code a lease by ``OTHER_UID`` gets (its rights, as the kernel
    names the caller)."""
    code = f"""
from migd.client import MigdClient
from migd.errors import MigdError
try:
    MigdClient({str(daemon.socket_path)!r}).lease(job_id="9.0", gpu_memory_mib=100, wait_s=0)
    print("ok")
except MigdError as e:
    print(e.code)
"""
    result = as_user(OTHER_UID, code)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def failures(daemon: DaemonProcess) -> list[dict[str, object]]:
    return [e for e in daemon.log_events() if e.get("event") == "config.reload_failed"]


def test_sighup_with_a_broken_file_keeps_the_old_configuration_whole(
    daemon: DaemonProcess,
) -> None:
    daemon.config_text = GOOD
    daemon.start()
    client = daemon.client()
    assert lease_as_other_uid(daemon) == "ok"
    why = {
        "empty": "no settings at all",
        "comments only": "no settings at all",
        "cut short at a line": "api.lease_users is no longer set",
        "cut short mid-line": "not valid TOML",
        "non-UTF-8 byte": "not UTF-8: byte 0xff",
    }
    for n, (name, content) in enumerate(BROKEN.items(), start=1):
        daemon.config_path.write_bytes(content)
        daemon.signal(signal.SIGHUP)
        wait_for(lambda n=n: len(failures(daemon)) == n, what=f"the {name} reload refused")
        failure = failures(daemon)[-1]
        assert why[name] in str(failure["error"]), (name, failure)
        assert failure["level"] == "error"
        assert client.status()["daemon"]["policy"]["queue"] == "size", name
        assert client.ping()
    assert "Traceback" not in daemon.log_path.read_text()
    assert not [e for e in daemon.log_events() if e.get("event") == "config.reloaded"]
    assert lease_as_other_uid(daemon) == "ok"  # its lease rights survived every one

    # The same through migctl names what would be taken and how to apply it anyway ...
    daemon.config_path.write_bytes(BROKEN["cut short at a line"])
    refused = daemon.migctl("reload")
    assert refused.returncode != 0
    assert "api.lease_users" in refused.stderr and "--allow-removals" in refused.stderr
    # ... which applies it, when asked for explicitly.
    applied = daemon.migctl("reload", "--allow-removals")
    assert applied.returncode == 0, applied.stderr
    assert lease_as_other_uid(daemon) == NotAuthorized.code


def test_an_edit_that_names_its_keys_is_applied(daemon: DaemonProcess) -> None:
    daemon.config_text = GOOD
    daemon.start()
    daemon.config_path.write_text(
        'version = 1\n[policy]\nqueue = "fifo"\n[api]\nlease_users = ["root"]\n'
    )
    reply = daemon.migctl("reload", "--json")
    assert reply.returncode == 0 and json.loads(reply.stdout)["reloaded"], reply.stderr
    assert daemon.client().status()["daemon"]["policy"]["queue"] == "fifo"
    assert lease_as_other_uid(daemon) == NotAuthorized.code


@pytest.mark.parametrize("name", ["empty", "comments only", "cut short mid-line", "non-UTF-8 byte"])
def test_a_broken_file_at_start_exits_2_with_a_message(tmp_path: Path, name: str) -> None:
    config = tmp_path / "migd.toml"
    config.write_bytes(BROKEN[name])
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "migd",
            "--config",
            str(config),
            "--simulate",
            "1xA100-40GB",
            "--state-dir",
            str(tmp_path / "state"),
            "--runtime-dir",
            str(tmp_path / "run"),
            "--socket",
            str(tmp_path / "run" / "migd.sock"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"migd: configuration error: {config}: "), result.stderr
    assert "Traceback" not in result.stderr and "hint: " in result.stderr
    assert not (tmp_path / "state").exists()  # refused before anything was made
