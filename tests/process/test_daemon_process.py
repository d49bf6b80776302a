"""The real daemon as a process: its socket, its signals, its notify messages."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from migd.errors import LeaseTimeout, MigdError, NotAuthorized, ProtocolError
from tests.process.conftest import DaemonProcess, wait_for

# A second, unprivileged uid for the tests that need real peer credentials. The kernel
# takes any uid (setpriv needs no account), so nothing here depends on which users the host
# has: configurations name it by number, never by a name such as "nobody".
OTHER_UID = 65534


def instance_of(status: dict[str, Any], lease_id: str) -> dict[str, Any] | None:
    for gpu in status["gpus"]:
        for inst in gpu["instances"]:
            if inst["lease_id"] == lease_id:
                return inst
    return None


def as_user(uid: int, code: str) -> subprocess.CompletedProcess[str]:
    """Run Python code as another uid (peer credentials are the kernel's, not ours)."""
    return subprocess.run(
        [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            sys.executable,
            "-c",
            code,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        cwd=str(Path(__file__).resolve().parents[2]),
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )


def raw_exchange(path: Path, payload: bytes) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(payload)
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        # after an error reply the daemon closes the connection
        assert sock.recv(1) == b""
    reply: dict[str, Any] = json.loads(data)
    return reply


def test_ready_watchdog_lease_and_release(daemon: DaemonProcess) -> None:
    daemon.start()
    wait_for(lambda: "WATCHDOG=1" in daemon.read_notifications(), what="watchdog pings")
    client = daemon.client()
    # Memory is sampled at start, not only after the first 5 s period.
    wait_for(
        lambda: client.status()["gpus"][0]["memory_used_mib"] is not None,
        timeout_s=2.0,
        what="the first memory sample",
    )
    lease = client.lease(job_id="1.0", gpu_memory_mib=4000, wait_s=5)
    assert lease["state"] == "active"
    assert lease["profile"] == "1g.5gb"
    assert lease["env"]["CUDA_VISIBLE_DEVICES"].startswith("MIG-")
    inst = instance_of(client.status(), lease["lease_id"])
    assert inst is not None and inst["busy"] and inst["job_id"] == "1.0"
    assert inst["uuid"] == lease["mig_uuid"]
    client.release(lease["lease_id"])
    status = client.status()
    assert instance_of(status, lease["lease_id"]) is None
    idle = [i for g in status["gpus"] for i in g["instances"] if not i["busy"]]
    assert [(i["profile"], i["start"]) for i in idle] == [("1g.5gb", lease["start"])]
    history = client.call("history", job_id="1.0")["history"]
    assert {"submitted", "granted", "released"} <= {row["event"] for row in history}
    # The ended lease leaves memory but not the record: it is read back from the store,
    # and releasing it again is harmless.
    assert client.call("get_lease", lease_id=lease["lease_id"])["state"] == "released"
    assert client.release(lease["lease_id"])["already"] is True
    # Latency is kept per kind of grant: the first lease waited for its instance to be
    # created; the second reuses the idle instance at once.
    again = client.lease(job_id="2.0", gpu_memory_mib=4000, wait_s=5)
    assert again["start"] == lease["start"] and not again["prepared"] and lease["prepared"]
    latency = client.status()["daemon"]["latency_ms"]
    assert latency["lease.prepared"]["n"] == 1 and latency["lease"]["n"] == 1
    assert latency["release"]["n"] == 2
    assert 0 < latency["lease"]["p50"] <= latency["lease"]["max"]
    shown = subprocess.run(
        [sys.executable, "-m", "migd.cli.migctl", "--socket", str(daemon.socket_path), "status"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    assert "service time p50/p99 ms" in shown and "lease.prepared" in shown, shown


def test_malformed_messages_get_errors_and_the_daemon_keeps_serving(daemon: DaemonProcess) -> None:
    daemon.start()
    path = daemon.socket_path
    cases = [
        b"garbage\n",
        b"[1, 2]\n",
        b"{}\n",
        b'{"version": 2, "op": "ping"}\n',
        b'{"version": 1, "op": "explode"}\n',
        b'{"version": 1, "op": "lease", "job_id": "1.0"}\n',
        b'{"version": 1, "op": "lease", "job_id": "x", "gpu_memory_mib": -5}\n',
        b'{"version": 1, "op": "ping", "surprise": true}\n',
        b'{"version": 1, "op": "release", "lease_id": "../../etc"}\n',
    ]
    for payload in cases:
        reply = raw_exchange(path, payload)
        assert reply["ok"] is False, payload
        assert reply["error"]["code"] == ProtocolError.code, (payload, reply)
        assert reply["error"]["message"]
    huge = b'{"version": 1, "op": "ping", "pad": "' + b"x" * 200_000 + b'"}\n'
    reply = raw_exchange(path, huge)
    assert reply["error"]["code"] == ProtocolError.code
    assert "longer than" in reply["error"]["message"]
    # a client that connects and vanishes mid-line
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(path))
        sock.sendall(b'{"version": 1, "op"')
    assert daemon.client().ping()["backend"] == "simulated"
    assert daemon.proc is not None and daemon.proc.poll() is None


def test_request_larger_than_any_gpu_is_refused_at_once(daemon: DaemonProcess) -> None:
    daemon.start()
    with pytest.raises(MigdError) as err:
        daemon.client().lease(job_id="9.0", gpu_memory_mib=500_000, wait_s=60)
    assert err.value.code == "request_too_large"
    assert "40448 MiB" in err.value.message


def test_queued_request_is_granted_when_capacity_frees(daemon: DaemonProcess) -> None:
    daemon.start()
    client = daemon.client()
    first = client.lease(job_id="1.0", gpu_memory_mib=40000, wait_s=5)
    second = client.lease(job_id="2.0", gpu_memory_mib=40000, wait_s=5)
    assert {first["gpu"], second["gpu"]} == {0, 1}
    got: dict[str, Any] = {}

    def wait_third() -> None:
        got["lease"] = daemon.client(timeout_s=30).lease(
            job_id="3.0", gpu_memory_mib=19000, wait_s=20
        )

    waiter = threading.Thread(target=wait_third)
    waiter.start()
    wait_for(lambda: client.status()["queue"], what="the third request to queue")
    assert client.status()["queue"][0]["job_id"] == "3.0"
    client.release(first["lease_id"])
    waiter.join(30)
    third = got["lease"]
    assert third["state"] == "active" and third["gpu"] == first["gpu"]
    # the idle 7g was repartitioned (fission) into the 3g the job needed
    assert third["profile"] == "3g.20gb"
    assert third["decision"]["action"] == "repartition"


def test_waiting_client_that_hangs_up_is_cancelled(daemon: DaemonProcess) -> None:
    daemon.start()
    client = daemon.client()
    for n in range(2):
        client.lease(job_id=f"{n}.0", gpu_memory_mib=40000, wait_s=5)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(daemon.socket_path))
        sock.sendall(
            b'{"version": 1, "op": "lease", "job_id": "7.0", "gpu_memory_mib": 1000, '
            b'"wait_s": 60}\n'
        )
        wait_for(lambda: client.status()["queue"], what="queued")
    wait_for(lambda: not client.status()["queue"], what="the hung-up request to leave the queue")
    ended = [x for x in client.call("leases", all=True)["leases"] if x["job_id"] == "7.0"]
    assert ended and ended[0]["state"] == "cancelled"
    assert "disconnected" in ended[0]["reason"]


def test_wait_deadline_expires(daemon: DaemonProcess) -> None:
    daemon.start()
    client = daemon.client()
    for n in range(2):
        client.lease(job_id=f"{n}.0", gpu_memory_mib=40000, wait_s=5)
    with pytest.raises(LeaseTimeout):
        client.lease(job_id="late.0", gpu_memory_mib=1000, wait_s=1.5)
    # and SIGTERM still stops it, at once: the sampler loop used to lose its cancellation
    # (Python 3.11's wait_for) and the daemon hung until SIGKILL
    began = time.monotonic()
    assert daemon.stop() == 0
    assert time.monotonic() - began < 10
    stuck = {"daemon.task_recancelled", "daemon.task_stuck"}
    assert not [e for e in daemon.log_events() if e.get("event") in stuck]


def test_sighup_reloads_and_keeps_old_config_on_error(daemon: DaemonProcess) -> None:
    daemon.start()
    client = daemon.client()
    assert client.status()["daemon"]["policy"]["queue"] == "fifo"
    daemon.config_path.write_text('version = 1\n[policy]\nqueue = "size"\n')
    daemon.signal(signal.SIGHUP)
    wait_for(lambda: client.status()["daemon"]["policy"]["queue"] == "size", what="reload")
    daemon.config_path.write_text('version = 1\n[policy]\nqueue = "lifo"\n')
    daemon.signal(signal.SIGHUP)
    wait_for(
        lambda: any(e.get("event") == "config.reload_failed" for e in daemon.log_events()),
        what="reload failure logged",
    )
    failure = next(e for e in daemon.log_events() if e.get("event") == "config.reload_failed")
    assert "policy.queue" in failure["error"]
    assert client.status()["daemon"]["policy"]["queue"] == "size"


def test_a_reply_comes_only_once_what_the_request_wrote_is_committed(
    daemon: DaemonProcess,
) -> None:
    """The daemon commits the requests of one turn of its event loop together, at the
    turn's end (issue 26 §4); a client hears of a grant or a release only after that
    commit, so what it was told is on disk, as another reader of the database sees."""
    import sqlite3

    holder = subprocess.Popen(["sleep", "120"])
    try:
        daemon.start()
        client = daemon.client()
        db = sqlite3.connect(daemon.root / "state" / "migd.db")
        for n in range(20):
            lease = client.lease(
                job_id=f"7.{n}", gpu_memory_mib=9000, wait_s=5, holder_pid=holder.pid
            )
            state = "SELECT state FROM leases WHERE lease_id=?"
            assert db.execute(state, (lease["lease_id"],)).fetchone() == ("active",)
            client.release(lease["lease_id"])
            assert db.execute(state, (lease["lease_id"],)).fetchone() == ("released",)
        db.close()
    finally:
        holder.kill()
        holder.wait()


def test_sigterm_stops_cleanly_and_keeps_active_leases(daemon: DaemonProcess) -> None:
    holder = subprocess.Popen(["sleep", "120"])
    try:
        daemon.start()
        lease = daemon.client().lease(
            job_id="5.0", gpu_memory_mib=9000, wait_s=5, holder_pid=holder.pid
        )
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0
        assert "STOPPING=1" in daemon.read_notifications()
        assert not daemon.socket_path.exists()
        import sqlite3

        db = sqlite3.connect(daemon.root / "state" / "migd.db")
        state = db.execute(
            "SELECT state FROM leases WHERE lease_id=?", (lease["lease_id"],)
        ).fetchone()
        assert state == ("active",)
    finally:
        holder.kill()
        holder.wait()


def test_dead_holder_is_reclaimed(daemon: DaemonProcess) -> None:
    holder = subprocess.Popen(["sleep", "120"])
    daemon.start()
    client = daemon.client()
    lease = client.lease(job_id="6.0", gpu_memory_mib=9000, wait_s=5, holder_pid=holder.pid)
    holder.kill()
    holder.wait()
    wait_for(lambda: instance_of(client.status(), lease["lease_id"]) is None, what="reclaim")
    ended = [
        x for x in client.call("leases", all=True)["leases"] if x["lease_id"] == lease["lease_id"]
    ]
    assert ended[0]["state"] == "reclaimed"
    assert "holder" in ended[0]["reason"]


def test_instance_with_processes_is_never_destroyed(daemon: DaemonProcess) -> None:
    holder = subprocess.Popen(["sleep", "120"])
    daemon.start()
    client = daemon.client()
    lease = client.lease(job_id="8.0", gpu_memory_mib=9000, wait_s=5, holder_pid=holder.pid)
    # a CUDA process of the job outlives its wrapper
    client.call("sim_attach", pid=424242, device_uuid=lease["mig_uuid"])
    client.call("sim_alloc", pid=424242, mib=2000)
    holder.kill()
    holder.wait()
    wait_for(lambda: instance_of(client.status(), lease["lease_id"]) is None, what="reclaim")
    gpu = client.status()["gpus"][lease["gpu"]]
    [inst] = [i for i in gpu["instances"] if i["uuid"] == lease["mig_uuid"]]
    assert inst["origin"] == "unexplained" and inst["busy"]
    result = client.call("reset", gpu=str(lease["gpu"]))
    assert result["destroying"] == []
    assert f"{inst['profile']}@{inst['start']}" in result["kept_busy"]
    client.call("sim_detach", pid=424242)
    wait_for(
        lambda: any(
            i["uuid"] == lease["mig_uuid"] and i["origin"] == "migd" and not i["busy"]
            for i in client.status()["gpus"][lease["gpu"]]["instances"]
        ),
        what="the emptied instance to be adopted",
    )


def test_job_exit_hook_path_releases_by_job_id(daemon: DaemonProcess) -> None:
    daemon.start()
    client = daemon.client()
    lease = client.lease(job_id="11.0", gpu_memory_mib=4000, wait_s=5)
    assert client.call("release_job", job_id="11.0")["released"] == [lease["lease_id"]]
    assert client.call("release_job", job_id="11.0")["released"] == []


def test_other_users_are_refused_by_peer_credentials(daemon: DaemonProcess) -> None:
    daemon.config_text = 'version = 1\n[api]\nlease_users = ["root"]\nlease_groups = []\n'
    daemon.start()
    lease = daemon.client().lease(job_id="1.0", gpu_memory_mib=4000, wait_s=5)
    code = f"""
import json
from migd.client import MigdClient
from migd.errors import MigdError
c = MigdClient({str(daemon.socket_path)!r})
out = {{}}
for name, call in [
    ("lease", lambda: c.lease(job_id="evil.0", gpu_memory_mib=100, wait_s=0)),
    ("release", lambda: c.release({lease["lease_id"]!r})),
    ("get_lease", lambda: c.call("get_lease", lease_id={lease["lease_id"]!r})),
    ("drain", lambda: c.call("drain", gpu="0")),
    ("status", lambda: c.status()["leases"]),
    ("leases", lambda: sorted(c.call("leases")["leases"][0])),
]:
    try:
        out[name] = ["ok", call()]
    except MigdError as e:
        out[name] = [e.code, e.message]
print(json.dumps(out))
"""
    result = as_user(OTHER_UID, code)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    for op in ("lease", "release", "get_lease", "drain"):
        assert out[op][0] == NotAuthorized.code, (op, out[op])
    assert out["status"][0] == "ok"  # status is public by default
    assert out["leases"][0] == "ok" and "env" not in out["leases"][1]
    assert daemon.client().call("get_lease", lease_id=lease["lease_id"])["state"] == "active"


def test_private_status_when_configured(daemon: DaemonProcess) -> None:
    daemon.config_text = (
        'version = 1\n[api]\nstatus_public = false\nlease_users = ["root"]\nlease_groups = []\n'
    )
    daemon.start()
    code = f"from migd.client import MigdClient\nMigdClient({str(daemon.socket_path)!r}).status()"
    # first line of defence: the socket file is not world-accessible
    assert daemon.socket_path.stat().st_mode & 0o777 == 0o660
    blocked = as_user(OTHER_UID, code)
    assert blocked.returncode != 0 and "no permission to connect" in blocked.stderr
    # second line: even with the file opened up, the peer's uid decides
    daemon.socket_path.chmod(0o666)
    refused = as_user(OTHER_UID, code)
    assert refused.returncode != 0 and "may not read" in refused.stderr


@pytest.mark.parametrize("problem", ["world-writable", "symlink"])
def test_unsafe_socket_directories_are_refused(tmp_path: Path, problem: str) -> None:
    root = Path("/tmp") / f"migd-unsafe-{os.getpid()}-{problem}"
    subprocess.run(["rm", "-rf", str(root)], check=False)
    root.mkdir()
    try:
        real = root / "real"
        real.mkdir()
        if problem == "world-writable":
            real.chmod(0o777)
            sock_dir = real
        else:
            real.chmod(0o755)
            sock_dir = root / "link"
            sock_dir.symlink_to(real)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "migd",
                "--simulate",
                "1xA100-40GB",
                "--state-dir",
                str(root / "state"),
                "--socket",
                str(sock_dir / "migd.sock"),
                "--log-format",
                "json",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 2  # a configuration error: systemd must not retry it
        assert problem in result.stderr
        assert not (real / "migd.sock").exists()
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


def test_migctl_exit_codes(daemon: DaemonProcess) -> None:
    migctl = daemon.migctl

    down = migctl("status")
    assert down.returncode == 3 and "not running" in down.stderr and "hint:" in down.stderr
    daemon.start()
    up = migctl("status")
    assert up.returncode == 0 and "GPU 0" in up.stdout and "[" in up.stdout
    as_json = json.loads(migctl("status", "--json").stdout)
    assert as_json["schema"] == 1 and len(as_json["gpus"]) == 2
    assert migctl("drain", "7").returncode == 1
    assert migctl("drain", "1").returncode == 0
    assert json.loads(migctl("status", "--json").stdout)["gpus"][1]["draining"] is True
    ad = migctl("condor-ad").stdout
    assert "MigdHealthy = true" in ad and "MigdLargestPlaceableMB = 40448" in ad
    assert migctl("bogus").returncode == 2


def test_a_drained_gpu_is_taken_offline_in_htcondor_and_back_on_resume(
    daemon: DaemonProcess,
) -> None:
    """The startd is told through the offline file and condor_reconfig (the fixture's
    stand-in records the call); a normal start tells it nothing."""
    daemon.start()
    offline = daemon.root / "run" / "condor-offline-gpus.config"
    calls = daemon.root / "condor-tool.log"
    status = daemon.status_json()
    uuid1 = status["gpus"][1]["uuid"]
    assert not offline.exists() and not calls.exists()
    assert daemon.migctl("drain", "1").returncode == 0
    wait_for(calls.exists, what="condor_reconfig after the drain")
    short = uuid1.split("-")[1]
    assert offline.read_text().splitlines()[-1] == (
        "OFFLINE_MACHINE_RESOURCE_GPUs = $(OFFLINE_MACHINE_RESOURCE_GPUs) "
        + ", ".join(f"GPU-s{n:02d}-{short}" for n in range(7))
    )
    assert calls.read_text().splitlines() == ["-daemon startd"]
    assert daemon.migctl("resume", "1").returncode == 0
    wait_for(lambda: len(calls.read_text().splitlines()) == 2, what="condor_reconfig after resume")
    assert "OFFLINE_MACHINE_RESOURCE_GPUs" not in offline.read_text()

    def logged() -> list[list[str]]:
        return [e["gpus"] for e in daemon.log_events() if e.get("event") == "condor.offline_gpus"]

    # The event is logged once the tool's thread has returned to the loop, after the call
    # the stand-in recorded: on a loaded host that comes later (seen beside 2 CPU hogs).
    wait_for(lambda: len(logged()) >= 2, what="the resume's condor.offline_gpus event")
    assert logged() == [[uuid1], []]


# -- cross-user security ------------------------------------------------------------------------

CLIENT_SCRIPT = """
import json, sys
from migd.client import MigdClient
from migd.errors import MigdError
c = MigdClient(sys.argv[1], timeout_s=30)
def attempt(call):
    try:
        return ["ok", call()]
    except MigdError as e:
        return [e.code, e.message]
"""


def test_release_job_is_for_the_owner_admins_and_hook_users(daemon: DaemonProcess) -> None:
    """With lease_users = ["*"] (the wrapper runs as the job's user), another user may not
    release a job's leases by its id, nor read their environment through explain."""
    daemon.config_text = 'version = 1\n[api]\nlease_users = ["*"]\nhook_users = []\n'
    daemon.start()
    root_lease = daemon.client().lease(job_id="11.0", gpu_memory_mib=4000, wait_s=5)
    code = (
        CLIENT_SCRIPT
        + """
out = {}
out["release_other"] = attempt(lambda: c.call("release_job", job_id="11.0"))
out["explain_other"] = attempt(lambda: c.call("explain", job_id="11.0"))
mine = c.lease(job_id="12.0", gpu_memory_mib=4000, wait_s=5)
out["explain_own"] = attempt(lambda: c.call("explain", job_id="12.0"))
out["release_own"] = attempt(lambda: c.call("release_job", job_id="12.0"))
out["mine"] = mine["lease_id"]
print(json.dumps(out))
"""
    )
    returncode, stdout, stderr = run_as(OTHER_UID, code, str(daemon.socket_path))
    assert returncode == 0, stderr
    out = json.loads(stdout)
    assert out["release_other"][0] == NotAuthorized.code, out["release_other"]
    assert "hook_users" in out["release_other"][1] or "uid 0" in out["release_other"][1]
    client = daemon.client()
    assert client.call("get_lease", lease_id=root_lease["lease_id"])["state"] == "active"
    # explain shows another user's lease without its environment, one's own with it
    [other] = out["explain_other"][1]["leases"]
    assert other["lease_id"] == root_lease["lease_id"] and "env" not in other
    [own] = out["explain_own"][1]["leases"]
    assert own["env"]["CUDA_VISIBLE_DEVICES"].startswith("MIG-")
    assert out["release_own"] == ["ok", {"released": [out["mine"]]}]
    # root (an admin) sees every environment
    assert client.call("explain", job_id="11.0")["leases"][0]["env"]
    # a hook user (here: OTHER_UID, via a reload) may release any job's leases
    daemon.config_path.write_text(
        f'version = 1\n[api]\nlease_users = ["*"]\nhook_users = ["{OTHER_UID}"]\n'
    )
    daemon.signal(signal.SIGHUP)
    wait_for(
        lambda: any(e.get("event") == "config.reloaded" for e in daemon.log_events()),
        what="the reload",
    )
    hook = as_user(
        OTHER_UID,
        f"from migd.client import MigdClient\n"
        f"print(MigdClient({str(daemon.socket_path)!r}).call('release_job', job_id='11.0'))",
    )
    assert hook.returncode == 0, hook.stderr
    assert root_lease["lease_id"] in hook.stdout
    assert client.call("get_lease", lease_id=root_lease["lease_id"])["state"] == "released"


def test_private_socket_group_lets_lease_users_in_and_reload_reapplies(
    daemon: DaemonProcess,
) -> None:
    private = f'version = 1\n[api]\nstatus_public = false\nlease_users = ["root", "{OTHER_UID}"]\n'
    daemon.config_text = private
    daemon.start()
    status = f"from migd.client import MigdClient\nMigdClient({str(daemon.socket_path)!r}).status()"
    st = daemon.socket_path.stat()
    assert st.st_mode & 0o777 == 0o660 and st.st_gid == os.getegid()
    # without socket_group, the lease user OTHER_UID cannot connect, and migd says so at start
    assert "no permission to connect" in as_user(OTHER_UID, status).stderr
    warning = next(e for e in daemon.log_events() if e.get("event") == "api.socket_private")
    assert warning["level"] == "warning" and "socket_group" in warning["hint"]

    def reload(text: str) -> None:
        count = sum(e.get("event") == "config.reloaded" for e in daemon.log_events())
        daemon.config_path.write_text(text)
        daemon.signal(signal.SIGHUP)
        wait_for(
            lambda: sum(e.get("event") == "config.reloaded" for e in daemon.log_events()) > count,
            what="the reload",
        )

    reload(private + f'socket_group = "{OTHER_UID}"\n')  # a gid: as_user's gid is its uid
    st = daemon.socket_path.stat()
    assert st.st_mode & 0o777 == 0o660 and st.st_gid == OTHER_UID
    assert as_user(OTHER_UID, status).returncode == 0  # its group is the socket's
    assert "no permission to connect" in run_as(65533, status)[2]
    # an unknown group fails the reload and keeps the socket as it was
    daemon.config_path.write_text(private + 'socket_group = "no-such-group-x"\n')
    daemon.signal(signal.SIGHUP)
    wait_for(
        lambda: any(
            e.get("event") == "config.reload_failed" and "no-such-group-x" in e.get("error", "")
            for e in daemon.log_events()
        ),
        what="the failed reload",
    )
    assert daemon.socket_path.stat().st_gid == OTHER_UID
    reload(f'version = 1\n[api]\nstatus_public = true\nlease_users = ["root", "{OTHER_UID}"]\n')
    assert daemon.socket_path.stat().st_mode & 0o777 == 0o666


# -- denial of service --------------------------------------------------------------------------

HOLDER_SCRIPT = """
import json, socket, sys, time
path, n = sys.argv[1], int(sys.argv[2])
socks = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    socks.append(s)
began = time.monotonic()
print(json.dumps({"held": n}), flush=True)
sys.stdin.readline()
replies = []
for s in socks:
    s.settimeout(30)
    data = s.recv(65536)
    replies.append([time.monotonic() - began, json.loads(data) if data else None])
print(json.dumps(replies), flush=True)
"""

PROBE_SCRIPT = """
import json, sys
from migd.client import MigdClient
from migd.errors import MigdError
try:
    print(json.dumps(["ok", MigdClient(sys.argv[1], timeout_s=10).status()["schema"]]))
except MigdError as e:
    print(json.dumps([e.code, e.message, e.hint]))
"""


def _as(uid: int, script: str, *args: str) -> subprocess.Popen[str]:
    repo = str(Path(__file__).resolve().parents[2])
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return subprocess.Popen(
        [*drop, sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": repo},
    )


def run_as(uid: int, script: str, *args: str) -> tuple[int, str, str]:
    """Run Python code as ``uid`` (gid the same, no other groups): (status, out, err)."""
    proc = _as(uid, script, *args)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def _probe(uid: int, path: Path) -> list[Any]:
    returncode, out, err = run_as(uid, PROBE_SCRIPT, str(path))
    assert returncode == 0, err
    result: list[Any] = json.loads(out)
    return result


def test_idle_connections_time_out_and_are_capped_per_uid(daemon: DaemonProcess) -> None:
    """Idle connections cannot starve migd: each uid may hold a few, users who may not
    lease never take the last quarter of the slots, and a silent connection is closed."""
    daemon.config_text = (
        "version = 1\n[api]\nmax_clients = 8\nmax_clients_per_uid = 3\n"
        'request_timeout_s = 8.0\nlease_users = ["root", "65530"]\nlease_groups = []\n'
    )
    daemon.start()
    path = daemon.socket_path
    holders = []
    try:
        for uid in (OTHER_UID, 65533):  # two users who may not lease hold 3 idle connections each
            holder = _as(uid, HOLDER_SCRIPT, str(path), "3")
            assert holder.stdout is not None
            assert json.loads(holder.stdout.readline()) == {"held": 3}
            holders.append(holder)
        # a fourth connection of the same uid is refused at once, with a hint that fits
        over = _probe(OTHER_UID, path)
        assert over[0] == "daemon_unavailable" and "max_clients_per_uid" in over[1], over
        assert "ss -xp" in over[2]
        # 6 of 8 slots are taken by readers: another reader is refused, a lease user is not
        refused = _probe(65532, path)
        assert refused[0] == "daemon_unavailable" and "too many connections" in refused[1]
        assert _probe(65530, path) == ["ok", 1]
        assert daemon.client().status()["schema"] == 1  # root is never refused
        # the idle connections get an error reply and are closed after request_timeout_s
        for holder in holders:
            out, _ = holder.communicate("go\n", timeout=30)
            replies = json.loads(out)
            for waited, reply in replies:
                assert reply is not None and reply["error"]["code"] == ProtocolError.code
                assert "within 8 s" in reply["error"]["message"]
                assert 5 < waited < 20
        assert _probe(OTHER_UID, path) == ["ok", 1]  # their slots were given back
    finally:
        for holder in holders:
            if holder.poll() is None:
                holder.kill()
                holder.wait()


# -- decoding, reports, status -----------------------------------------------------------------


def test_deep_nesting_and_report_keys_are_handled(daemon: DaemonProcess) -> None:
    daemon.start()
    path = daemon.socket_path
    deep = b"[" * 20000 + b"]" * 20000 + b"\n"
    for payload in (
        deep,
        b'{"version": 1, "op": "ping", "x": ' + b"[" * 20000 + b"]" * 20000 + b"}\n",
        b'{"version": true, "op": "ping"}\n',
        b'{"version": 1.0, "op": "ping"}\n',
    ):
        reply = raw_exchange(path, payload)
        assert reply["error"]["code"] == ProtocolError.code, reply
        assert "internal" not in reply["error"]["message"]
    client = daemon.client()
    lease = client.lease(job_id="r.0", gpu_memory_mib=4000, wait_s=5)
    data = {
        "lease": 1,
        "event": "forged",
        "lease_id": "other",
        "job_id": "other.0",
        "level": "critical",
        "timestamp": "1999-01-01",
        "peak_used_mib": 123,
    }
    result = client.call("report", lease_id=lease["lease_id"], event="note", data=data)
    assert result == {"recorded": True}
    history = client.call("history", job_id="r.0")["history"]
    [row] = [r for r in history if r["event"] == "wrapper.note"]
    assert row["data"] == data and row["lease_id"] == lease["lease_id"]
    [logged] = [e for e in daemon.log_events() if e.get("event") == "wrapper.note"]
    assert logged["level"] == "info" and logged["timestamp"] != "1999-01-01"
    assert logged["lease_id"] == lease["lease_id"] and logged["data"] == data
    assert not any(e.get("event") == "request.crashed" for e in daemon.log_events())


def test_status_stays_fast_and_the_watchdog_fed_during_a_slow_create(
    daemon: DaemonProcess,
) -> None:
    # A 1g create takes 0.16 s x 50 = 8 s on the simulated A100; WATCHDOG_USEC is 2 s.
    daemon.extra_args += ["--set", "backend.sim_time_scale=50"]
    daemon.start()
    client = daemon.client()
    got: dict[str, Any] = {}
    waiter = threading.Thread(
        target=lambda: got.update(
            lease=daemon.client(timeout_s=60).lease(job_id="s.0", gpu_memory_mib=4000, wait_s=30)
        )
    )
    waiter.start()
    wait_for(lambda: client.status()["leases"]["preparing"] == 1, what="the create to start")
    daemon.read_notifications()
    pings_before = daemon.notifications.count("WATCHDOG=1")
    slowest, answered_while_preparing = 0.0, 0
    while waiter.is_alive():
        began = time.perf_counter()
        status = client.status()
        slowest = max(slowest, time.perf_counter() - began)
        if status["leases"]["preparing"] == 0:
            break
        answered_while_preparing += 1
        time.sleep(0.1)
    waiter.join(30)
    assert got["lease"]["prepared"] and got["lease"]["state"] == "active"
    # Status queued behind the 8 s create would answer once or twice while it runs; one that
    # never waits for the GPU thread answers every poll. The bound on one answer is half the
    # create: one that waited would take all of it, a loaded host (load 15) takes about 1 s.
    assert answered_while_preparing >= 10, answered_while_preparing
    assert slowest < 4.0, f"status took {slowest:.3f} s during an 8 s create"
    daemon.read_notifications()
    # pinged every 0.5 s while the GPU thread was busy for ~8 s (WatchdogSec = 2 s)
    assert daemon.notifications.count("WATCHDOG=1") - pings_before >= 4
    assert not any(e.get("event") == "watchdog.starved" for e in daemon.log_events())


# -- the documented status schema ---------------------------------------------------------------

STATUS_SCHEMA = Path(__file__).resolve().parents[2] / "docs" / "status.schema.json"
JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


def schema_errors(value: Any, schema: dict[str, Any], where: str = "$") -> list[str]:
    """Check ``value`` against the JSON Schema subset docs/status.schema.json uses."""
    if "oneOf" in schema:
        fits = [not schema_errors(value, option, where) for option in schema["oneOf"]]
        return [] if fits.count(True) == 1 else [f"{where}: fits {fits.count(True)} of oneOf"]
    errors: list[str] = []
    if "const" in schema and value != schema["const"]:
        errors.append(f"{where}: {value!r} is not {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} not in {schema['enum']}")
    if "type" in schema:
        types = [schema["type"]] if isinstance(schema["type"], str) else schema["type"]
        ok = any(
            isinstance(value, JSON_TYPES[t]) and not (t != "boolean" and isinstance(value, bool))
            for t in types
        )
        if not ok:
            return [f"{where}: {value!r} is not {types}"]
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{where}: {key!r} is missing")
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                errors += schema_errors(item, props[key], f"{where}.{key}")
            elif extra is False:
                errors.append(f"{where}: {key!r} is not in the documented schema")
            elif isinstance(extra, dict):
                errors += schema_errors(item, extra, f"{where}.{key}")
    if isinstance(value, list) and "items" in schema:
        for n, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{where}[{n}]")
    return errors


def test_status_json_matches_the_documented_schema(daemon: DaemonProcess) -> None:
    """One MIG, one MPS and one exclusive GPU, with leases and a queued request: every
    branch of the status reply is checked against docs/status.schema.json."""
    daemon.simulate = "1xA100-40GB,2xV100-32GB"
    daemon.config_text = 'version = 1\n[[gpu]]\nmatch = "2"\nmode = "exclusive"\n'
    daemon.start()
    client = daemon.client()
    client.lease(job_id="m.0", gpu_memory_mib=4000, mode="mig", wait_s=5)
    client.lease(job_id="p.0", gpu_memory_mib=4000, mode="mps", wait_s=5)
    client.lease(job_id="x.0", gpu_memory_mib=30000, gpus=["2"], wait_s=5)

    def queued() -> None:
        with contextlib.suppress(MigdError):  # granted or cancelled at teardown
            daemon.client(timeout_s=30).lease(
                job_id="q.0", gpu_memory_mib=30000, gpus=["2"], wait_s=10
            )

    waiter = threading.Thread(target=queued)
    waiter.start()
    try:
        wait_for(lambda: client.status()["queue"], what="the queued request")
        migctl = [sys.executable, "-m", "migd.cli.migctl", "--socket", str(daemon.socket_path)]
        shown = subprocess.run(
            [*migctl, "status", "--json"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
        status = json.loads(shown)
        assert {g["mode"] for g in status["gpus"]} == {"mig", "mps", "exclusive"}
        assert status["queue"] and status["gpus"][0]["instances"]
        assert status["gpus"][1]["mps"]["shares"] and status["gpus"][2]["exclusive"]["lease_id"]
        schema = json.loads(STATUS_SCHEMA.read_text())
        assert schema_errors(status, schema) == []
        # the check can fail: an undocumented field, a wrong type, a missing field
        status["gpus"][0]["surprise"] = 1
        status["queue"][0]["position"] = "first"
        del status["daemon"]["pid"]
        assert len(schema_errors(status, schema)) == 3
    finally:
        client.call("release_job", job_id="x.0")
        waiter.join(30)


def test_explain_and_history_take_the_job_id_condor_q_shows(daemon: DaemonProcess) -> None:
    """Leases carry GlobalJobIds; admins type ClusterId.ProcId. One match is that job,
    matches from two access points are refused with the candidates."""
    daemon.start()
    client = daemon.client()
    lease = client.lease(job_id="ap1#41.3#1700000000", gpu_memory_mib=4000, wait_s=5)
    shown = client.call("explain", job_id="41.3")
    assert shown["job_id"] == "ap1#41.3#1700000000"
    assert [x["lease_id"] for x in shown["leases"]] == [lease["lease_id"]]
    events = [h["event"] for h in client.call("history", job_id="41.3")["history"]]
    assert "granted" in events
    assert client.call("explain", job_id="41.33")["leases"] == []  # no prefix matching
    client.lease(job_id="ap2#41.3#1700000100", gpu_memory_mib=4000, wait_s=5)
    with pytest.raises(MigdError) as info:
        client.call("explain", job_id="41.3")
    assert info.value.code == "invalid_request"
    assert "ap1#41.3#1700000000" in str(info.value) and "ap2#41.3#1700000100" in str(info.value)
    full = client.call("explain", job_id="ap2#41.3#1700000100")
    assert len(full["leases"]) == 1
