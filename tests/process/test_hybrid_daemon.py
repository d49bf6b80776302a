"""The hybrid MIG+MPS policy in the real daemon process on simulated A100s.

``mode = "hybrid"`` decides per job between a MIG instance of its own and a pinned share
of an MPS server inside a MIG instance (a *host*, ``migd.core.hybrid``). These tests
drive it through the socket and ``migctl`` as a job and an admin would.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.process.conftest import DaemonProcess, wait_for
from tests.process.test_daemon_process import OTHER_UID

HYBRID = """version = 1
[api]
lease_users = ["*"]
[[gpu]]
match = "*"
mode = "hybrid"
share = "either"
"""


@pytest.fixture
def hybrid(daemon: DaemonProcess) -> DaemonProcess:
    daemon.simulate = "2xA100-40GB"
    daemon.config_text = HYBRID
    # the per-user MPS daemon runs as the job's user, who cannot execute this venv's python
    daemon.env["MIGD_FAKE_MPS_PYTHON"] = "/usr/bin/python3"
    return daemon


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes that hold leases (the wrapper's stand-in) until the test ends."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def lease(
    daemon: DaemonProcess,
    holders: list[subprocess.Popen[bytes]],
    job_id: str,
    mib: int,
    **fields: Any,
) -> dict[str, Any]:
    h = subprocess.Popen(["sleep", "300"])
    holders.append(h)
    got: dict[str, Any] = daemon.client().lease(
        job_id=job_id, gpu_memory_mib=mib, wait_s=10, holder_pid=h.pid, **fields
    )
    assert got["state"] == "active", got
    return got


def instances(daemon: DaemonProcess) -> list[dict[str, Any]]:
    return [i for g in daemon.client().status()["gpus"] for i in g["instances"]]


def host_of(daemon: DaemonProcess, lease_id: str) -> dict[str, Any] | None:
    """The MIG instance whose MPS server holds ``lease_id``'s share (as status shows it
    now: compare hosts by ``uuid``, the rest changes between calls)."""
    for inst in instances(daemon):
        shares = (inst.get("mps") or {}).get("shares", [])
        if any(s["lease_id"] == lease_id for s in shares):
            return inst
    return None


def uuid_of(inst: dict[str, Any] | None) -> str | None:
    return None if inst is None else str(inst["uuid"])


@contextlib.contextmanager
def other_user_lease(daemon: DaemonProcess, job_id: str, mib: int) -> Iterator[dict[str, Any]]:
    """A lease held by uid ``OTHER_UID`` (peer credentials are the kernel's): the process
    leases, prints the lease and holds it until its stdin closes."""
    code = f"""
import json, sys
from migd.client import MigdClient
c = MigdClient({str(daemon.socket_path)!r}, timeout_s=60)
print(json.dumps(c.lease(job_id={job_id!r}, gpu_memory_mib={mib}, wait_s=30)), flush=True)
sys.stdin.read()
"""
    proc = subprocess.Popen(
        [
            *("setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"),
            *(sys.executable, "-c", code),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        yield json.loads(line)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def test_small_jobs_share_a_pinned_host_and_a_big_job_gets_its_own_instance(
    hybrid: DaemonProcess, holders: list[subprocess.Popen[bytes]]
) -> None:
    hybrid.start()
    a = lease(hybrid, holders, "hy.0", 3000)
    b = lease(hybrid, holders, "hy.1", 3000)
    big = lease(hybrid, holders, "hy.2", 15000)

    # 3 GB on an A100-40GB packs denser shared (the rule "either", by size): MPS shares
    # inside one MIG instance, each pinned to its own request
    assert a["mode"] == "mps" and b["mode"] == "mps"
    assert a["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3000M"
    assert b["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3000M"
    host = host_of(hybrid, a["lease_id"])
    assert host is not None and uuid_of(host_of(hybrid, b["lease_id"])) == host["uuid"]
    assert host["lease_id"] is None  # the host belongs to no single lease
    assert a["env"]["CUDA_VISIBLE_DEVICES"] == host["uuid"]
    pipe = Path(a["env"]["CUDA_MPS_PIPE_DIRECTORY"])
    assert pipe == Path(b["env"]["CUDA_MPS_PIPE_DIRECTORY"])
    assert (pipe / "nvidia-cuda-mps-control.pid").exists()  # its server runs
    assert host["mps"]["pinned_mib"] == 6000 and host["mps"]["uid"] == os.getuid()

    # 15 GB packs no better shared: a MIG instance of its own, no MPS in it
    assert big["mode"] == "mig"
    [own] = [i for i in instances(hybrid) if i["lease_id"] == big["lease_id"]]
    assert own["uuid"] != host["uuid"] and "mps" not in own
    assert big["env"]["CUDA_VISIBLE_DEVICES"] == own["uuid"]
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in big["env"]

    # migctl explain starts with the hybrid's reason, for both decisions
    small_why = hybrid.migctl("explain", "hy.0")
    assert small_why.returncode == 0, small_why.stderr
    assert "why: hybrid:" in small_why.stdout and "packs" in small_why.stdout
    big_why = hybrid.migctl("explain", "hy.2")
    assert "why: hybrid:" in big_why.stdout and "packs no better shared" in big_why.stdout

    # migctl status shows the host instance and its two shares
    status = hybrid.migctl("status")
    assert status.returncode == 0, status.stderr
    host_line = next(line for line in status.stdout.splitlines() if host["uuid"] in line)
    assert host["profile"] in host_line and "MPS, 2 job(s)" in host_line
    as_json = json.loads(hybrid.migctl("status", "--json").stdout)
    [shown] = [i for g in as_json["gpus"] for i in g["instances"] if i["uuid"] == host["uuid"]]
    assert {s["job_id"] for s in shown["mps"]["shares"]} == {"hy.0", "hy.1"}
    assert {s["pinned_mib"] for s in shown["mps"]["shares"]} == {3000}


def test_a_host_whose_last_client_leaves_is_destroyed(
    hybrid: DaemonProcess, holders: list[subprocess.Popen[bytes]]
) -> None:
    hybrid.start()
    a = lease(hybrid, holders, "hd.0", 3000)
    b = lease(hybrid, holders, "hd.1", 3000)
    host = host_of(hybrid, a["lease_id"])
    assert host is not None
    hybrid.client().release(a["lease_id"])
    # one client left: the host stays, with its server
    assert [i["uuid"] for i in instances(hybrid)] == [host["uuid"]]
    hybrid.client().release(b["lease_id"])
    wait_for(
        lambda: host["uuid"] not in {i["uuid"] for i in instances(hybrid)},
        what="the emptied host to be destroyed",
    )
    assert instances(hybrid) == []
    # its MPS server was stopped first: the control daemon's pid file is gone
    pipe = Path(a["env"]["CUDA_MPS_PIPE_DIRECTORY"])
    wait_for(
        lambda: not (pipe / "nvidia-cuda-mps-control.pid").exists(),
        what="the host's MPS server to stop",
    )


def test_two_users_small_jobs_never_share_one_mps_server(
    hybrid: DaemonProcess, holders: list[subprocess.Popen[bytes]]
) -> None:
    hybrid.start()
    mine = lease(hybrid, holders, "hu.0", 3000)
    with other_user_lease(hybrid, "hu.1", 3000) as theirs:
        assert theirs["state"] == "active" and theirs["mode"] == "mps"
        assert theirs["owner_uid"] == OTHER_UID
        my_host = host_of(hybrid, mine["lease_id"])
        their_host = host_of(hybrid, theirs["lease_id"])
        assert my_host is not None and their_host is not None
        # MPS's rule (one server per user per device, unless multi_user): another host
        assert my_host["uuid"] != their_host["uuid"]
        assert my_host["mps"]["uid"] == os.getuid() and their_host["mps"]["uid"] == OTHER_UID
        assert mine["env"]["CUDA_MPS_PIPE_DIRECTORY"] != theirs["env"]["CUDA_MPS_PIPE_DIRECTORY"]
        # a second job of mine joins my host, not theirs
        again = lease(hybrid, holders, "hu.2", 3000)
        assert uuid_of(host_of(hybrid, again["lease_id"])) == my_host["uuid"]


def test_multi_user_lets_two_users_share_one_host(
    hybrid: DaemonProcess, holders: list[subprocess.Popen[bytes]]
) -> None:
    hybrid.config_text = HYBRID + "[mps]\nmulti_user = true\n"
    hybrid.start()
    mine = lease(hybrid, holders, "hm.0", 3000)
    with other_user_lease(hybrid, "hm.1", 3000) as theirs:
        assert theirs["state"] == "active" and theirs["mode"] == "mps"
        host = host_of(hybrid, mine["lease_id"])
        assert host is not None and uuid_of(host_of(hybrid, theirs["lease_id"])) == host["uuid"]
        assert host["mps"]["multi_user"] is True
