"""MPS through the real daemon: a simulated non-MIG GPU, the stand-in control daemon."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from migd.backends.simulated.mps_control import fault_path
from migd.core.mps import client_context_mib
from migd.errors import MigdError
from tests.mps.conftest import pid_alive
from tests.process.conftest import DaemonProcess, wait_for
from tests.process.test_daemon_process import OTHER_UID, as_user
from tests.process.test_wrapper_process import SIMJOB, run


@pytest.fixture(autouse=True)
def _no_mps_daemon_left(daemon: DaemonProcess) -> Iterator[None]:
    """migd keeps MPS daemons of active leases across its stop (on purpose): once it has
    stopped, kill the stand-in daemons this test's migd started (their working directory
    is their pipe directory, under the test's root)."""
    yield
    daemon.stop()
    root = str(daemon.root)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cwd = os.readlink(proc / "cwd")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if cwd.startswith(root) and b"fake_mps_control" in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)


def mps_status(daemon: DaemonProcess) -> dict[str, Any]:
    gpu = daemon.client().status()["gpus"][0]
    assert gpu["mode"] == "mps"
    mps: dict[str, Any] = gpu["mps"]
    return mps


def test_mps_lease_gets_a_pinned_limit_and_its_own_daemon(daemon: DaemonProcess) -> None:
    daemon.simulate = "1xV100-32GB"
    daemon.start()
    lease = daemon.client().lease(job_id="m.0", gpu_memory_mib=4000, wait_s=5)
    env = lease["env"]
    assert lease["mode"] == "mps"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4000M"
    pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
    assert pipe.is_relative_to(daemon.root / "run")  # private, per GPU, not /tmp/nvidia-mps
    assert (pipe / "nvidia-cuda-mps-control.pid").exists()
    status = mps_status(daemon)
    assert status["pinned_mib"] == 4000 and status["uid"] == os.getuid()
    [control] = status["daemons"]
    os.kill(int(control["pid"]), 0)  # the control daemon runs
    daemon.client().release(lease["lease_id"])
    assert mps_status(daemon)["shares"] == []


def test_client_over_its_limit_is_an_oom_and_restarts_bigger(daemon: DaemonProcess) -> None:
    daemon.simulate = "1xV100-32GB"
    daemon.start()
    result = run(
        daemon,
        "--gpu-memory",
        "2G",
        "--job-id",
        "mo.0",
        "--",
        *SIMJOB,
        "--start",
        "1G",
        "--grow",
        "1G",
        "--steps",
        "3",
        "--step-s",
        "0.01",
    )
    assert result.returncode == 0, result.stderr
    assert "CUDA out of memory" in result.stderr
    assert "MPS share of 2048 MiB" in result.stderr and "MPS share of 4096 MiB" in result.stderr


def test_one_user_at_a_time_per_mps_server(daemon: DaemonProcess) -> None:
    daemon.simulate = "1xV100-32GB"
    daemon.config_text = 'version = 1\n[api]\nlease_users = ["*"]\n'
    # the per-user MPS daemon runs as the job's user, who cannot execute this venv's python
    daemon.env["MIGD_FAKE_MPS_PYTHON"] = "/usr/bin/python3"
    daemon.start()
    mine = daemon.client().lease(job_id="root.0", gpu_memory_mib=1000, wait_s=5)
    code = f"""
import json
from migd.client import MigdClient
c = MigdClient({str(daemon.socket_path)!r}, timeout_s=60)
lease = c.lease(job_id="nobody.0", gpu_memory_mib=1000, wait_s=30)
# Read while this process (the lease's holder) lives: once it exits, the reaper ends it.
uid = c.status()["gpus"][0]["mps"]["uid"]
print(json.dumps(dict(lease, serving_uid=uid)))
"""
    got: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: got.update(result=as_user(OTHER_UID, code)))
    waiter.start()
    wait_for(lambda: daemon.client().status()["queue"], what="the other user's request to wait")
    assert mps_status(daemon)["draining_for_uid"] == OTHER_UID
    # while it drains, the serving user gets nothing new either (no starvation)
    blocked = daemon.client().call("leases")["leases"]
    assert any(x["job_id"] == "nobody.0" and x["state"] == "queued" for x in blocked)
    daemon.client().release(mine["lease_id"])
    waiter.join(60)
    result = got["result"]
    assert result.returncode == 0, result.stderr
    theirs = json.loads(result.stdout)
    assert theirs["state"] == "active" and theirs["owner_uid"] == OTHER_UID
    assert theirs["serving_uid"] == OTHER_UID


def test_sigterm_keeps_a_busy_mps_daemon_and_restart_adopts_it(daemon: DaemonProcess) -> None:
    with held_lease(daemon, "k.0"):
        [control] = mps_status(daemon)["daemons"]
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0
        os.kill(int(control["pid"]), 0)  # still serving the running job
        daemon.proc = None
        daemon.notifications.clear()  # wait for the new daemon's READY=1, not the old one's
        daemon.start()
        status = mps_status(daemon)
        assert [d["pid"] for d in status["daemons"]] == [control["pid"]]
        assert status["pinned_mib"] == 1000


UNAVAILABLE = "all CUDA-capable devices are busy or unavailable"


# -- helpers for the tests below -----------------------------------------------------------


def holder() -> subprocess.Popen[bytes]:
    """A process that holds a lease (the wrapper's stand-in) until killed."""
    return subprocess.Popen(["sleep", "300"])


@contextlib.contextmanager
def held_lease(daemon: DaemonProcess, job_id: str) -> Iterator[dict[str, Any]]:
    """migd on a simulated V100 and a 1000 MiB MPS lease for ``job_id``, held by a
    :func:`holder` that is killed at the end."""
    daemon.simulate = "1xV100-32GB"
    h = holder()
    try:
        daemon.start()
        yield daemon.client().lease(job_id=job_id, gpu_memory_mib=1000, wait_s=5, holder_pid=h.pid)
    finally:
        h.kill()
        h.wait()


def fake_control(pipe: str | Path, command: str) -> str:
    """Talk to a daemon's stand-in control daemon, as `nvidia-cuda-mps-control` would."""
    proc = subprocess.run(
        [sys.executable, "-m", "migd.backends.simulated.mps_control"],
        input=command + "\n",
        capture_output=True,
        text=True,
        timeout=20,
        env={"PATH": os.environ["PATH"], "CUDA_MPS_PIPE_DIRECTORY": str(pipe)},
        check=False,
    )
    return proc.stdout


def simjob(
    daemon: DaemonProcess, env: dict[str, str], *args: str, drop: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    job_env = {**os.environ, "MIGD_API_SOCKET": str(daemon.socket_path), **env}
    for name in drop:
        job_env.pop(name, None)
    return subprocess.run(
        [*SIMJOB, "--step-s", "0.01", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=job_env,
        check=False,
    )


def lease_row(daemon: DaemonProcess, lease_id: str) -> dict[str, Any]:
    rows = daemon.client().call("leases", all=True)["leases"]
    row: dict[str, Any] = next(x for x in rows if x["lease_id"] == lease_id)
    return row


# -- the pinned limit is enforced by the server, not only by the job's environment -------


def test_an_mps_job_s_cuda_context_counts_inside_its_share(daemon: DaemonProcess) -> None:
    """Issue 25: as on the H200, the simulated client's CUDA context (514 MiB at 100 % of
    the threads) is allocated at init inside its pinned limit: of a 2048 MiB share a job can
    allocate 2048 - 514 MiB, and a limit below the context fails at init."""
    daemon.simulate = "1xV100-32GB"
    h = holder()
    try:
        daemon.start()
        c = daemon.client()
        lease = c.lease(job_id="ctx.0", gpu_memory_mib=2048, wait_s=5, holder_pid=h.pid)
        fits = simjob(daemon, lease["env"], "--start", "1500M", "--steps", "0")
        assert fits.returncode == 0, fits.stderr
        over = simjob(daemon, lease["env"], "--start", "1600M", "--steps", "0")
        assert over.returncode == 1 and "CUDA out of memory" in over.stderr
        small = simjob(
            daemon,
            {**lease["env"], "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=512M"},
            *("--start", "64M", "--steps", "0"),
        )
        assert small.returncode == 1 and "CUDA error: out of memory" in small.stderr
        assert "the CUDA context, 514 MiB" in small.stderr
    finally:
        h.kill()
        h.wait()


def test_a_job_that_drops_its_limit_is_held_to_the_largest_share_by_the_server(
    daemon: DaemonProcess,
) -> None:
    daemon.simulate = "1xV100-32GB"
    small_holder, big_holder = holder(), holder()
    try:
        daemon.start()
        c = daemon.client()
        small = c.lease(job_id="s.0", gpu_memory_mib=2048, wait_s=5, holder_pid=small_holder.pid)
        c.lease(job_id="b.0", gpu_memory_mib=6144, wait_s=5, holder_pid=big_holder.pid)
        # With its variable: its own 2048 MiB.
        kept = simjob(daemon, small["env"], "--start", "2G", "--grow", "1G", "--steps", "1")
        assert kept.returncode == 1 and "CUDA out of memory" in kept.stderr
        assert "total capacity of 2.00 GiB" in kept.stderr
        # Without it, CUDA still goes through the MPS server (the pipe directory), whose
        # limit migd keeps at the largest active share: 6144 MiB, not the whole GPU.
        dropped = simjob(
            daemon,
            small["env"],
            *("--start", "6G", "--grow", "1G", "--steps", "1"),
            drop=("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",),
        )
        assert dropped.returncode == 1, dropped.stdout
        assert "total capacity of 6.00 GiB" in dropped.stderr
        # The variable cannot raise the server's limit either.
        raised = simjob(
            daemon,
            {**small["env"], "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=30G"},
            *("--start", "6G", "--grow", "1G", "--steps", "1"),
        )
        assert "total capacity of 6.00 GiB" in raised.stderr
    finally:
        for h in (small_holder, big_holder):
            h.kill()
            h.wait()


# -- declared clients and compute share -------------------------------------------------------


def test_clients_and_min_compute_reach_the_share_and_the_environment(
    daemon: DaemonProcess,
) -> None:
    daemon.simulate = "1xV100-32GB"
    daemon.start()
    c = daemon.client()
    lease = c.lease(job_id="c.0", gpu_memory_mib=3000, wait_s=5, mps_clients=3, min_compute=2)
    assert lease["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "29"  # 2 of 7 slices, up
    assert lease["mps_clients"] == 3 and lease["mps_thread_percentage"] == 29
    explicit = c.lease(job_id="c.1", gpu_memory_mib=1000, wait_s=5, mps_thread_percentage=10)
    assert explicit["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
    status = mps_status(daemon)
    assert status["pinned_mib"] == 3 * 3000 + 1000 and status["clients"] == 4
    share = next(s for s in status["shares"] if s["lease_id"] == lease["lease_id"])
    assert (share["clients"], share["thread_percentage"]) == (3, 29)
    # memory x clients beyond the GPU never fits
    with pytest.raises(MigdError) as info:
        c.lease(job_id="c.2", gpu_memory_mib=16000, wait_s=0, mps_clients=2)
    assert info.value.code == "request_too_large"


# -- status never waits for an MPS daemon ---------------------------------------------------


def test_status_answers_at_once_while_the_mps_daemon_hangs(daemon: DaemonProcess) -> None:
    daemon.simulate = "1xV100-32GB"
    daemon.start()
    lease = daemon.client().lease(job_id="h.0", gpu_memory_mib=1000, wait_s=5)
    pipe = Path(lease["env"]["CUDA_MPS_PIPE_DIRECTORY"])
    wait_for(
        lambda: mps_status(daemon)["daemons"][0]["age_s"] is not None,
        what="a refreshed MPS status",
    )
    fault_path(pipe, "hang").touch()
    try:
        for _ in range(20):  # about 3 s: every call while the daemon hangs
            began = time.monotonic()
            status = mps_status(daemon)
            # one that asked the hung daemon would wait out its 10 s command timeout; half
            # of that is far above what a loaded host needs for a status
            assert time.monotonic() - began < 5.0
            (entry,) = status["daemons"]
            assert entry["age_s"] is not None
            time.sleep(0.15)
        ages = [mps_status(daemon)["daemons"][0]["age_s"] for _ in range(2)]
        assert ages[-1] >= 2.0  # the answers are old, and status says how old
    finally:
        fault_path(pipe, "hang").unlink(missing_ok=True)


# -- usage of an MPS lease is its own job's ----------------------------------------------------


CONTEXT = client_context_mib(100)  # the simulated MPS client's CUDA context


def test_usage_of_an_mps_lease_counts_only_its_own_jobs_processes(
    daemon: DaemonProcess,
) -> None:
    daemon.simulate = "1xV100-32GB"
    daemon.start()
    env = {**os.environ, "MIGD_API_SOCKET": str(daemon.socket_path)}
    jobs = {
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "migd.wrapper.main",
                "--socket",
                str(daemon.socket_path),
                "--gpu-memory",
                f"{size}G",
                "--mode",
                "mps",
                "--job-id",
                name,
                "--",
                *SIMJOB,
                *("--start", f"{size - 1}G", "--steps", "200", "--step-s", "0.05"),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, size in (("u.a", 2), ("u.b", 4))
    }
    try:
        c = daemon.client()

        def usages() -> dict[str, dict[str, Any]] | None:
            rows = {x["job_id"]: x for x in c.call("leases")["leases"] if x["state"] == "active"}
            if set(rows) != set(jobs):
                return None
            got = {job: c.call("usage", lease_id=row["lease_id"]) for job, row in rows.items()}
            # a CUDA context shows in NVML before the job's first allocation (the context
            # alone: 514 MiB under MPS, as recorded), so wait for more than that
            allocated = all(
                u["processes"] and all(p["used_mib"] > CONTEXT for p in u["processes"])
                for u in got.values()
            )
            return got if allocated else None

        got = wait_for(usages, what="both jobs to allocate")
        # NVML's per-process figure counts the client's CUDA context too (issue 25)
        assert {p["used_mib"] for p in got["u.a"]["processes"]} == {1024 + CONTEXT}
        assert {p["used_mib"] for p in got["u.b"]["processes"]} == {3072 + CONTEXT}
        # the device's figure is the whole device's: read again now that both have allocated
        # (u.a's first answer may predate u.b's allocation)
        (lease_a,) = [x["lease_id"] for x in c.call("leases")["leases"] if x["job_id"] == "u.a"]
        again = c.call("usage", lease_id=lease_a)
        assert again["scope"] == "job" and again["device_used_mib"] >= 4096
        # each share's peak is its own job's memory, not the device's
        assert got["u.a"]["peak_used_mib"] == 1024 + CONTEXT
        assert got["u.b"]["peak_used_mib"] == 3072 + CONTEXT
        (pid_a,) = [p["pid"] for p in got["u.a"]["processes"]]
        assert Path(f"/proc/{pid_a}/status").read_text().count("PPid") == 1
        assert (
            int(
                next(
                    line.split()[1]
                    for line in Path(f"/proc/{pid_a}/status").read_text().splitlines()
                    if line.startswith("PPid")
                )
            )
            == jobs["u.a"].pid
        )  # the wrapper's child
    finally:
        for proc in jobs.values():
            proc.terminate()
            proc.wait(30)


# -- lost clients flag the lease; GPU health recovers ---------------------------------------


def test_a_crashed_server_flags_its_leases_in_status_leases_and_explain(
    daemon: DaemonProcess,
) -> None:
    with held_lease(daemon, "x.0") as lease:
        fault_path(lease["env"]["CUDA_MPS_PIPE_DIRECTORY"], "crash-server").touch()
        row = wait_for(
            lambda: (r := lease_row(daemon, lease["lease_id"]))["warning"] and r,
            what="the lease to be flagged",
        )
        assert row["state"] == "active" and "MPS clients lost" in row["warning"]
        status = mps_status(daemon)
        assert status["shares"][0]["warning"] == row["warning"]
        text = migctl(daemon, "status")
        assert "WARNING: MPS clients lost" in text
        assert "WARNING: MPS clients lost" in migctl(daemon, "leases")
        assert "WARNING: MPS clients lost" in migctl(daemon, "explain", "x.0")
        assert "mps.clients_lost" in migctl(daemon, "history", "--job", "x.0")


def test_gpu_health_is_cleared_once_the_mps_daemon_can_be_restarted(
    daemon: DaemonProcess,
) -> None:
    shim = daemon.root / "run" / "sim-bin" / "nvidia-cuda-mps-control"
    with held_lease(daemon, "r.0") as lease:
        try:
            shim.chmod(0o644)  # the control binary cannot run: restarts fail
            fault_path(lease["env"]["CUDA_MPS_PIPE_DIRECTORY"], "die").touch()
            gpu = wait_for(
                lambda: (g := daemon.client().status()["gpus"][0])["health"] != "ok" and g,
                what="the GPU to be marked",
            )
            assert gpu["health"].startswith("MPS daemon cannot be restarted")
            shim.chmod(0o755)
            wait_for(
                lambda: daemon.client().status()["gpus"][0]["health"] == "ok",
                what="the health mark to clear",
            )
            [control] = mps_status(daemon)["daemons"]
            os.kill(int(control["pid"]), 0)
        finally:
            shim.chmod(0o755)


# -- reports from the wrapper ---------------------------------------------------------------


def test_a_wrappers_devices_unavailable_report_restarts_an_mps_daemon_without_clients(
    daemon: DaemonProcess,
) -> None:
    """No client is connected (the lease's job has none yet): the refusal means a sick
    server, and the restart loses nobody, so no lease is flagged (issue 25; a daemon with
    connected clients is never restarted for a refused client: tests/mps)."""
    with held_lease(daemon, "d.0") as lease:
        c = daemon.client()
        [before] = mps_status(daemon)["daemons"]
        reply = c.call(
            "report",
            lease_id=lease["lease_id"],
            event="mps_client_error",
            data={"message": f"RuntimeError: CUDA error: {UNAVAILABLE}"},
        )
        assert reply["recorded"] is True and reply["device"] == lease["gpu_uuid"]
        wait_for(
            lambda: [d["pid"] for d in mps_status(daemon)["daemons"]] not in ([], [before["pid"]]),
            what="a new MPS daemon",
        )
        events = [r["event"] for r in c.call("history", job_id="d.0")["history"]]
        assert "wrapper.mps_client_error" in events and "mps.clients_lost" not in events
        with pytest.raises(MigdError) as info:
            c.call("report", lease_id=lease["lease_id"], event="mps_client_error", data={})
        assert info.value.code == "invalid_request"


# -- mode=mps on a MIG GPU ------------------------------------------------------------------


def test_mode_mps_on_a_mig_enabled_gpu_is_refused_with_a_hint(daemon: DaemonProcess) -> None:
    daemon.simulate = "1xA100-40GB"
    daemon.config_text = 'version = 1\n[[gpu]]\nmatch = "0"\nmode = "mps"\n'
    daemon.start()
    (gpu,) = daemon.client().status()["gpus"]
    assert gpu["mig_current"] is True and gpu["healthy"] is False
    assert "mps_in_mig = true" in gpu["health"] and "MIG is enabled" in gpu["health"]
    with pytest.raises(MigdError):
        daemon.client().lease(job_id="n.0", gpu_memory_mib=1000, wait_s=0)


# -- restart of migd with a dead MPS daemon ---------------------------------------------------


def test_restart_with_a_dead_mps_daemon_flags_the_lease(daemon: DaemonProcess) -> None:
    with held_lease(daemon, "z.0") as lease:
        [control] = mps_status(daemon)["daemons"]
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0
        os.kill(int(control["pid"]), signal.SIGKILL)  # dies while migd is down
        daemon.proc = None
        daemon.notifications.clear()
        daemon.start()
        row = lease_row(daemon, lease["lease_id"])
        assert row["state"] == "active" and "died while migd was down" in row["warning"]
        [fresh] = mps_status(daemon)["daemons"]
        assert fresh["pid"] != control["pid"]
        events = [r["event"] for r in daemon.client().call("history", job_id="z.0")["history"]]
        assert "mps.clients_lost" in events


# -- MPS inside MIG ---------------------------------------------------------------------------


MPS_IN_MIG = 'version = 1\n[[gpu]]\nmatch = "0"\nmode = "mig"\nmps_in_mig = true\n'


def test_small_jobs_share_an_mps_instance_and_it_is_stopped_before_destroy(
    daemon: DaemonProcess,
) -> None:
    daemon.simulate = "1xA100-40GB"
    daemon.config_text = MPS_IN_MIG
    daemon.start()
    c = daemon.client()
    a = c.lease(job_id="m.a", gpu_memory_mib=1500, wait_s=10)
    b = c.lease(job_id="m.b", gpu_memory_mib=1200, wait_s=10)
    assert a["mode"] == b["mode"] == "mps" and a["profile"] == "1g.5gb"
    mig = a["mig_uuid"]
    assert mig.startswith("MIG-") and b["mig_uuid"] == mig
    assert a["env"]["CUDA_VISIBLE_DEVICES"] == mig
    pipe = Path(a["env"]["CUDA_MPS_PIPE_DIRECTORY"])
    assert (
        pipe == Path(b["env"]["CUDA_MPS_PIPE_DIRECTORY"])
        and (pipe / "nvidia-cuda-mps-control.pid").exists()
    )
    (inst,) = [i for i in c.status()["gpus"][0]["instances"] if i["uuid"] == mig]
    assert len(inst["mps"]["shares"]) == 2 and inst["mps"]["max_clients"] == 48 // 7
    [control] = inst["mps"]["daemons"]
    # A job on it is held to its share inside the instance.
    out = simjob(daemon, a["env"], "--start", "1G", "--grow", "1G", "--steps", "1")
    assert out.returncode == 1 and "total capacity of 1.46 GiB" in out.stderr
    c.release(a["lease_id"])
    c.release(b["lease_id"])
    # A client the books do not know (a leaked job process) keeps the instance.
    stray = holder()
    try:
        assert (
            fake_control(pipe, f"fake_register_client {stray.pid} {os.getuid()}").strip().isdigit()
        )
        c.call("reset", gpu="0")
        wait_for(
            lambda: "work.failed" in [r["event"] for r in c.call("history", limit=20)["history"]],
            what="the destroy to be refused",
        )
        assert any(i["uuid"] == mig for i in c.status()["gpus"][0]["instances"])
        os.kill(int(control["pid"]), 0)
    finally:
        stray.kill()
        stray.wait()
    # Without clients: the MPS daemon is stopped, then the instance destroyed.
    c.call("reset", gpu="0")
    wait_for(
        lambda: not any(i["uuid"] == mig for i in c.status()["gpus"][0]["instances"]),
        what="the MPS instance to go",
    )
    assert not pid_alive(int(control["pid"]))
    # A big job still gets its own instance, and mode=mps gets a share.
    big = c.lease(job_id="m.big", gpu_memory_mib=9000, wait_s=10)
    assert big["mode"] == "mig"
    share = c.lease(job_id="m.mps", gpu_memory_mib=2000, mode="mps", wait_s=10)
    assert share["mode"] == "mps" and share["mig_uuid"] != big["mig_uuid"]


def migctl(daemon: DaemonProcess, *args: str) -> str:
    """What a successful ``migctl ARGS`` prints."""
    result = daemon.migctl(*args, timeout_s=30)
    assert result.returncode == 0, result.stderr
    return result.stdout
