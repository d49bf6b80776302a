"""``kill -9`` the daemon mid-lease and restart it: leases intact, nothing leaked or lost.

The simulated GPUs live in the daemon process; ``backend.sim_state_file`` keeps them
in a file so they survive the daemon as real GPUs do. Each test runs the real
daemon (``tests/process/conftest.py``), crashes or stops it at a chosen moment and
starts it again on the same state directory and the same simulated GPUs.

Invariants checked after every restart:

* a lease that was active is active again, with the same GPU, profile, placement
  and MIG device, and its instance is busy with its job;
* a lease that was waiting is cancelled, with a reason;
* every instance on the GPUs is either held by an active lease or idle, and no
  instance appears that nobody asked for (nothing leaked);
* an instance with processes on it is never destroyed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from migd.errors import MigdError
from tests.process.conftest import DaemonProcess, wait_for

# -- helpers ------------------------------------------------------------------------------------


def persist_gpus(daemon: DaemonProcess, *settings: str) -> Path:
    """Give the daemon a simulated-GPU state file (plus ``--set`` settings); returns it."""
    state_file = daemon.root / "sim-gpus.json"
    daemon.extra_args += ["--set", f"backend.sim_state_file={state_file}"]
    for setting in settings:
        daemon.extra_args += ["--set", setting]
    return state_file


def crash(daemon: DaemonProcess) -> None:
    """SIGKILL: no shutdown code runs, exactly like an OOM kill or a power cut of the process."""
    daemon.signal(signal.SIGKILL)
    assert daemon.wait() == -signal.SIGKILL


def restart(daemon: DaemonProcess, *settings: str) -> int:
    """Start the daemon again on the same state dir and GPUs; returns its first log offset.

    ``settings`` (``key=value``) are added for this and later starts.
    """
    assert daemon.proc is not None and daemon.proc.poll() is not None, "still running"
    for setting in settings:
        daemon.extra_args += ["--set", setting]
    daemon.read_notifications()  # drop what the old process sent: wait for a new READY=1
    daemon.notifications.clear()
    offset = daemon.log_path.stat().st_size
    daemon.start()
    return offset


def events_since(daemon: DaemonProcess, offset: int) -> list[dict[str, Any]]:
    """The JSON log lines the daemon wrote after ``offset``."""
    with daemon.log_path.open("rb") as log:
        log.seek(offset)
        lines = log.read().decode(errors="replace").splitlines()
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def instances(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**inst, "gpu": gpu["index"]} for gpu in status["gpus"] for inst in gpu["instances"]]


def layout(status: dict[str, Any]) -> set[tuple[Any, ...]]:
    """What exists on the GPUs: (gpu, profile, start, MIG UUID) per instance."""
    return {(i["gpu"], i["profile"], i["start"], i["uuid"]) for i in instances(status)}


def lease_record(daemon: DaemonProcess, lease_id: str) -> dict[str, Any]:
    leases = daemon.client().call("leases", all=True)["leases"]
    [record] = [x for x in leases if x["lease_id"] == lease_id]
    return record  # type: ignore[no-any-return]


def leases_of_job(daemon: DaemonProcess, job_id: str) -> list[dict[str, Any]]:
    leases = daemon.client().call("leases", all=True)["leases"]
    return [x for x in leases if x["job_id"] == job_id]


def assert_consistent(daemon: DaemonProcess, status: dict[str, Any]) -> None:
    """Every instance is held by an active lease of its job, or idle and free to take."""
    leases = daemon.client().call("leases")["leases"]
    active = {x["lease_id"]: x for x in leases if x["state"] == "active"}
    for inst in instances(status):
        where = f"{inst['profile']}@{inst['start']} on GPU {inst['gpu']}: {inst}"
        if inst["lease_id"] is not None:
            lease = active.get(inst["lease_id"])
            assert lease is not None, f"held by a lease that is not active: {where}"
            assert (lease["gpu"], lease["start"], lease["mig_uuid"]) == (
                inst["gpu"],
                inst["start"],
                inst["uuid"],
            ), where
            assert inst["busy"] and inst["job_id"] == lease["job_id"], where
        else:
            assert not inst["busy"], f"neither leased nor idle: {where}"
            assert inst["origin"] != "unexplained", where
            assert inst["status"] == "ready", where


def spawn(procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["sleep", "120"])
    procs.append(proc)
    return proc


def end(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()


# -- 1. SIGKILL with an active lease --------------------------------------------------------------


def test_sigkill_mid_lease_keeps_the_lease_and_its_instance(
    daemon: DaemonProcess, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    persist_gpus(daemon)
    holder = spawn(sleepers)
    daemon.start()
    lease = daemon.client().lease(
        job_id="1.0", gpu_memory_mib=9000, wait_s=10, holder_pid=holder.pid
    )
    assert lease["state"] == "active" and lease["mig_uuid"].startswith("MIG-")
    before = daemon.status_json()

    crash(daemon)
    offset = restart(daemon)

    after = daemon.client().call("get_lease", lease_id=lease["lease_id"])
    assert after["state"] == "active"
    for key in ("gpu", "gpu_uuid", "profile", "start", "mig_uuid", "owner_pid"):
        assert after[key] == lease[key], key
    status = daemon.status_json()
    [inst] = [i for i in instances(status) if i["lease_id"] == lease["lease_id"]]
    assert inst["busy"] and inst["job_id"] == "1.0" and inst["uuid"] == lease["mig_uuid"]
    assert inst["origin"] == "migd"
    assert layout(status) == layout(before)  # nothing leaked, nothing destroyed
    assert_consistent(daemon, status)
    restored = [e for e in events_since(daemon, offset) if e.get("event") == "lease.restored"]
    assert [e["lease_id"] for e in restored] == [lease["lease_id"]]
    # the restored lease still works end to end
    daemon.client().release(lease["lease_id"])
    assert lease_record(daemon, lease["lease_id"])["state"] == "released"


# -- 2. the holder dies while the daemon is down -----------------------------------------------


@pytest.mark.parametrize("idle_policy", ["timeout", "destroy"])
def test_holder_dying_while_down_is_reclaimed_and_the_busy_instance_kept(
    daemon: DaemonProcess, sleepers: list[subprocess.Popen[bytes]], idle_policy: str
) -> None:
    # idle_policy=destroy: a reclaimed instance is torn down at once, unless in use
    persist_gpus(daemon, f"policy.idle_policy={idle_policy}")
    holder, cuda = spawn(sleepers), spawn(sleepers)
    daemon.start()
    client = daemon.client()
    lease = client.lease(job_id="2.0", gpu_memory_mib=9000, wait_s=10, holder_pid=holder.pid)
    # a CUDA process of the job, which outlives its wrapper
    client.call("sim_attach", pid=cuda.pid, device_uuid=lease["mig_uuid"])
    client.call("sim_alloc", pid=cuda.pid, mib=2000)
    before = daemon.status_json()

    crash(daemon)
    end(holder)
    offset = restart(daemon)

    record = lease_record(daemon, lease["lease_id"])
    assert record["state"] == "reclaimed" and "holder" in record["reason"]
    # the decision is in the log too, as a warning with its reason
    [logged] = [
        e
        for e in events_since(daemon, offset)
        if e.get("event") == "lease.reclaimed" and e.get("lease_id") == lease["lease_id"]
    ]
    assert logged["level"] == "warning" and "holder" in logged["reason"]
    status = daemon.status_json()
    assert layout(status) == layout(before)
    [inst] = [i for i in instances(status) if i["uuid"] == lease["mig_uuid"]]
    assert inst["lease_id"] is None and inst["busy"] and inst["origin"] == "unexplained"
    reset = daemon.client().call("reset", gpu=str(lease["gpu"]))
    assert reset["destroying"] == []
    assert f"{inst['profile']}@{inst['start']}" in reset["kept_busy"]
    # A negative can only be watched over time: several reaper passes (0.2 s each)
    # must leave the instance in place and untouchable while the process is there.
    time.sleep(1.0)
    [still] = [i for i in instances(daemon.status_json()) if i["uuid"] == lease["mig_uuid"]]
    assert still["busy"] and still["origin"] == "unexplained"

    daemon.client().call("sim_detach", pid=cuda.pid)

    def idle() -> dict[str, Any] | None:
        for i in instances(daemon.client().status()):
            if i["uuid"] == lease["mig_uuid"] and not i["busy"]:
                return i
        return None

    emptied = wait_for(idle, what="the emptied instance to become idle")
    assert emptied["origin"] != "unexplained" and emptied["start"] == inst["start"]
    assert layout(daemon.status_json()) == layout(before)
    assert_consistent(daemon, daemon.status_json())


def test_holder_and_cuda_process_dying_while_down_free_the_instance(
    daemon: DaemonProcess, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    persist_gpus(daemon)
    holder, cuda = spawn(sleepers), spawn(sleepers)
    daemon.start()
    client = daemon.client()
    lease = client.lease(job_id="2.1", gpu_memory_mib=9000, wait_s=10, holder_pid=holder.pid)
    client.call("sim_attach", pid=cuda.pid, device_uuid=lease["mig_uuid"])
    before = daemon.status_json()

    crash(daemon)
    end(holder)
    end(cuda)  # its CUDA context dies with it, daemon or not
    restart(daemon)

    assert lease_record(daemon, lease["lease_id"])["state"] == "reclaimed"
    status = daemon.status_json()
    assert layout(status) == layout(before)
    [inst] = [i for i in instances(status) if i["uuid"] == lease["mig_uuid"]]
    assert not inst["busy"] and inst["lease_id"] is None
    assert_consistent(daemon, status)


def test_a_waiting_job_never_gets_an_instance_a_dead_holders_process_still_uses(
    daemon: DaemonProcess, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    persist_gpus(daemon)
    holder, other, cuda = spawn(sleepers), spawn(sleepers), spawn(sleepers)
    daemon.start()
    client = daemon.client()
    first = client.lease(job_id="8.0", gpu_memory_mib=40000, wait_s=10, holder_pid=holder.pid)
    client.lease(job_id="8.1", gpu_memory_mib=40000, wait_s=10, holder_pid=other.pid)
    client.call("sim_attach", pid=cuda.pid, device_uuid=first["mig_uuid"])
    crash(daemon)
    restart(daemon)  # both leases restored; the node is full
    outcome: dict[str, Any] = {}

    def wait_in_queue() -> None:
        try:
            outcome["lease"] = daemon.client(timeout_s=30).lease(
                job_id="8.2", gpu_memory_mib=40000, wait_s=15
            )
        except (MigdError, OSError) as exc:
            outcome["error"] = exc

    waiter = threading.Thread(target=wait_in_queue)
    waiter.start()
    try:
        wait_for(lambda: daemon.client().status()["queue"], what="the third job to queue")
        end(holder)  # the first job's wrapper dies; its CUDA process does not
        wait_for(
            lambda: lease_record(daemon, first["lease_id"])["state"] == "reclaimed",
            what="the reaper to reclaim the first lease",
        )
        [inst] = [i for i in instances(daemon.client().status()) if i["uuid"] == first["mig_uuid"]]
        # The instance still runs the dead job's process: nobody else may get it yet.
        assert inst["lease_id"] is None, f"handed to {inst['job_id']} while still in use"
        assert inst["busy"] and inst["origin"] == "unexplained"
        assert "lease" not in outcome
    finally:
        daemon.client().call("sim_detach", pid=cuda.pid)
        waiter.join(30)
    # Once the process is gone the waiting job gets the instance.
    assert outcome.get("lease", {}).get("mig_uuid") == first["mig_uuid"], outcome


# -- 3. a request waiting in the queue -------------------------------------------------------------


def test_sigkill_with_a_queued_request_cancels_it_and_creates_nothing(
    daemon: DaemonProcess,
) -> None:
    persist_gpus(daemon)
    daemon.start()
    client = daemon.client()
    full = [client.lease(job_id=f"{n}.0", gpu_memory_mib=40000, wait_s=10) for n in range(2)]
    outcome: dict[str, Any] = {}

    def wait_in_queue() -> None:
        try:
            outcome["lease"] = daemon.client(timeout_s=30).lease(
                job_id="3.0", gpu_memory_mib=19000, wait_s=20
            )
        except (MigdError, OSError) as exc:
            outcome["error"] = exc

    waiter = threading.Thread(target=wait_in_queue)
    waiter.start()
    wait_for(lambda: client.status()["queue"], what="the request to queue")
    before = daemon.status_json()

    [decision] = [
        e for e in events_since(daemon, 0) if e.get("event") == "lease.queued"
    ]  # the queueing decision was logged, with where it stands
    assert decision["job_id"] == "3.0" and decision["position"] == 1 and decision["reason"]
    crash(daemon)
    waiter.join(30)
    assert "error" in outcome and "lease" not in outcome  # its client saw the daemon go
    offset = restart(daemon)

    [queued] = leases_of_job(daemon, "3.0")
    assert queued["state"] == "cancelled"
    assert "restarted" in queued["reason"]
    assert any(
        e.get("event") == "lease.cancelled" and e.get("job_id") == "3.0"
        for e in events_since(daemon, offset)
    )
    status = daemon.status_json()
    assert status["queue"] == []
    assert layout(status) == layout(before)  # no instance for the cancelled request
    for lease in full:
        assert lease_record(daemon, lease["lease_id"])["state"] == "active"
    assert_consistent(daemon, status)


# -- 4. SIGKILL in the middle of NVML work ---------------------------------------------------------


def test_sigkill_while_an_instance_is_being_created(
    daemon: DaemonProcess, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    daemon.simulate = "1xA100-40GB"
    persist_gpus(daemon)
    holder = spawn(sleepers)
    daemon.start()
    client = daemon.client()
    kept = client.lease(job_id="4.0", gpu_memory_mib=4000, wait_s=10, holder_pid=holder.pid)
    spare = client.lease(job_id="4.1", gpu_memory_mib=4000, wait_s=10)
    client.release(spare["lease_id"])  # an idle 1g.5gb next to the leased one
    daemon.signal(signal.SIGTERM)
    assert daemon.wait() == 0
    # [Villarrubia] Table 1 x 20: creating a 3g instance takes 4 s (a 1g 3.2 s)
    restart(daemon, "backend.sim_time_scale=20")
    outcome: dict[str, Any] = {}

    def ask() -> None:
        try:
            outcome["lease"] = daemon.client(timeout_s=30).lease(
                job_id="4.2", gpu_memory_mib=19000, wait_s=25
            )
        except (MigdError, OSError) as exc:
            outcome["error"] = exc

    asker = threading.Thread(target=ask)
    asker.start()
    wait_for(
        lambda: any(i["status"] == "creating" for i in instances(daemon.client().status())),
        what="the creation to start",
    )
    time.sleep(1.0)  # well inside the creation

    crash(daemon)
    asker.join(30)
    assert "lease" not in outcome
    restart(daemon, "backend.sim_time_scale=0")

    [lease] = leases_of_job(daemon, "4.2")
    assert lease["state"] in ("cancelled", "active"), lease
    assert lease_record(daemon, kept["lease_id"])["state"] == "active"
    status = daemon.status_json()
    assert_consistent(daemon, status)
    idle = {f"{i['profile']}@{i['start']}" for i in instances(status) if not i["busy"]}
    busy = {(i["gpu"], i["start"], i["uuid"]) for i in instances(status) if i["busy"]}
    assert (kept["gpu"], kept["start"], kept["mig_uuid"]) in busy

    result = daemon.migctl("reset", "0", "--json")
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)["destroying"]) == {f"destroy {x}" for x in idle}
    wait_for(
        lambda: (
            {(i["gpu"], i["start"], i["uuid"]) for i in instances(daemon.status_json())} == busy
        ),
        what="reset to destroy the idle instances only",
    )
    # and the rest of the GPU is usable again
    again = daemon.client().lease(job_id="4.3", gpu_memory_mib=19000, wait_s=10)
    assert again["state"] == "active" and again["mig_uuid"].startswith("MIG-")


@pytest.mark.parametrize("then", ["reset", "reuse"])
def test_sigkill_while_a_repartition_destroys_the_old_instance(
    daemon: DaemonProcess, then: str
) -> None:
    daemon.simulate = "1xA100-40GB"
    persist_gpus(daemon)
    daemon.start()
    client = daemon.client()
    whole = client.lease(job_id="5.0", gpu_memory_mib=40000, wait_s=10)
    client.release(whole["lease_id"])  # leaves an idle 7g.40gb
    daemon.signal(signal.SIGTERM)
    assert daemon.wait() == 0
    # [Villarrubia] Table 1 x 20: destroying the 7g takes 4.4 s, creating the 3g 4.0 s
    restart(daemon, "backend.sim_time_scale=20")
    outcome: dict[str, Any] = {}

    def ask() -> None:
        try:
            outcome["lease"] = daemon.client(timeout_s=30).lease(
                job_id="5.1", gpu_memory_mib=19000, wait_s=25
            )
        except (MigdError, OSError) as exc:
            outcome["error"] = exc

    asker = threading.Thread(target=ask)
    asker.start()
    wait_for(
        lambda: any(i["status"] == "destroying" for i in instances(daemon.client().status())),
        what="the repartition to start",
    )
    time.sleep(1.5)  # inside the destruction of the 7g.40gb

    crash(daemon)
    asker.join(30)
    assert "lease" not in outcome
    restart(daemon, "backend.sim_time_scale=0")

    [lease] = leases_of_job(daemon, "5.1")
    assert lease["state"] == "cancelled", lease
    # Whatever the crash left on the GPU must be reusable or removable: poll a few
    # reaper passes for the daemon to make sense of it.
    wait_for(
        lambda: _consistent(daemon),
        timeout_s=5,
        what="every instance to be leased or idle",
    )
    if then == "reset":
        daemon.client().call("reset", gpu="0")
        wait_for(lambda: not instances(daemon.client().status()), what="reset to empty the GPU")
    # A job that needs the whole GPU gets a usable MIG device, whatever the crash left.
    again = daemon.client().lease(job_id="5.2", gpu_memory_mib=40000, wait_s=10)
    assert again["state"] == "active", again
    assert (again["mig_uuid"] or "").startswith("MIG-"), json.dumps(again)
    assert again["env"]["CUDA_VISIBLE_DEVICES"] == again["mig_uuid"], again["env"]
    [inst] = instances(daemon.client().status())
    assert inst["uuid"] == again["mig_uuid"] and inst["lease_id"] == again["lease_id"]


def _consistent(daemon: DaemonProcess) -> bool:
    try:
        assert_consistent(daemon, daemon.client().status())
    except AssertionError:
        return False
    return True


# -- 5. SIGTERM and restart ------------------------------------------------------------------------


def test_sigterm_and_restart_keep_active_leases(
    daemon: DaemonProcess, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    persist_gpus(daemon)
    holders = [spawn(sleepers) for _ in range(3)]
    daemon.start()
    client = daemon.client()
    leases = [
        client.lease(job_id=f"6.{n}", gpu_memory_mib=mib, wait_s=10, holder_pid=holder.pid)
        for n, (mib, holder) in enumerate(zip((4000, 9000, 19000), holders, strict=True))
    ]
    before = daemon.status_json()

    daemon.signal(signal.SIGTERM)
    assert daemon.wait() == 0
    offset = restart(daemon)

    for lease in leases:
        after = daemon.client().call("get_lease", lease_id=lease["lease_id"])
        assert after["state"] == "active"
        for key in ("gpu", "profile", "start", "mig_uuid"):
            assert after[key] == lease[key], key
    status = daemon.status_json()
    assert layout(status) == layout(before)
    assert {i["lease_id"] for i in instances(status) if i["busy"]} == {
        x["lease_id"] for x in leases
    }
    assert_consistent(daemon, status)
    restored = {
        e["lease_id"] for e in events_since(daemon, offset) if e.get("event") == "lease.restored"
    }
    assert restored == {x["lease_id"] for x in leases}


# -- the state file belongs to its GPUs ---------------------------------------------------------


def test_restart_with_other_gpus_refuses_the_state_file_and_keeps_it(
    daemon: DaemonProcess,
) -> None:
    state_file = persist_gpus(daemon)
    daemon.start()
    lease = daemon.client().lease(job_id="7.0", gpu_memory_mib=4000, wait_s=10)
    crash(daemon)
    saved = state_file.read_bytes()
    daemon.simulate = "3xA100-40GB"
    offset = restart_without_waiting(daemon)
    assert daemon.wait() == 2  # a configuration error: systemd must not retry it
    [failed] = [e for e in events_since(daemon, offset) if e.get("event") == "daemon.start_failed"]
    assert "backend.sim_state_file" in failed["message"] and "delete" in failed["hint"]
    assert state_file.read_bytes() == saved
    daemon.simulate = "2xA100-40GB"
    restart(daemon)
    assert daemon.client().call("get_lease", lease_id=lease["lease_id"])["state"] == "active"


def restart_without_waiting(daemon: DaemonProcess) -> int:
    daemon.read_notifications()
    daemon.notifications.clear()
    offset = daemon.log_path.stat().st_size
    daemon.start(wait_ready=False)
    return offset
