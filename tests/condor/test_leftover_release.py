"""A lease released while a process of its job still runs on the MIG instance: the
sampler's next round (or the next hand-out, whichever comes first) finds it, the
instance is quarantined (never reused or destroyed), the processes are reported with
the lease in status, history and the log, and the instance is adopted again once they
exit. With ``idle_policy = "destroy"`` the teardown that follows the release refuses
to destroy it first (it lists the processes itself)."""

from __future__ import annotations

from typing import Any

from tests.process.conftest import DaemonProcess, wait_for

LEFTOVER_PID = 424242  # a pid in the simulated GPU only: no host process is touched


def _instance(status: dict[str, Any], gpu: int, uuid: str) -> dict[str, Any] | None:
    found = [i for i in status["gpus"][gpu]["instances"] if i["uuid"] == uuid]
    return found[0] if found else None


def _check(daemon: DaemonProcess, release: str) -> None:
    daemon.simulate = "1xA100-40GB"
    daemon.extra_args += ["--set", "policy.idle_policy=destroy"]
    daemon.start()
    client = daemon.client()
    first = client.lease(job_id="ap#1.0#1", gpu_memory_mib=4000, mode="mig", wait_s=10)
    # the job's CUDA child outlives it (setsid, or a condor_rm that missed it)
    client.call("sim_attach", pid=LEFTOVER_PID, device_uuid=first["mig_uuid"])
    client.call("sim_alloc", pid=LEFTOVER_PID, mib=3000)
    if release == "lease":
        result = client.release(first["lease_id"], reason="job attempt ended")
        assert result["state"] == "released" and "leftover_pids" not in result
    else:  # the JOB_EXIT hook's path
        client.call("release_job", job_id="ap#1.0#1", reason="JOB_EXIT hook (exit)")

    def reported() -> dict[str, Any] | None:
        inst = _instance(client.status(), first["gpu"], first["mig_uuid"])
        if inst is None or first["lease_id"] not in inst["note"]:
            return None
        return inst

    # the destroy idle policy did not take it, and it is reported with the pid and lease
    inst = wait_for(reported, what="the sampler to quarantine the instance, naming the lease")
    assert inst["busy"] and inst["origin"] == "unexplained"
    assert str(LEFTOVER_PID) in inst["note"]
    history = client.call("history", job_id="ap#1.0#1", limit=20)["history"]
    assert any(h["event"] == "leftover_processes" for h in history)
    logged = [e for e in daemon.log_events() if e.get("event") == "lease.leftover_processes"]
    assert logged and logged[0]["pids"] == [LEFTOVER_PID]
    # the next lease of the same size gets another instance, not the one in use
    second = client.lease(job_id="ap#2.0#1", gpu_memory_mib=4000, mode="mig", wait_s=10)
    assert second["mig_uuid"] != first["mig_uuid"]
    client.release(second["lease_id"])
    # once the process exits, the instance is migd's again (the reaper's resync)
    client.call("sim_detach", pid=LEFTOVER_PID)
    wait_for(
        lambda: (
            (i := _instance(client.status(), first["gpu"], first["mig_uuid"])) is None
            or not i["busy"]
        ),
        what="the emptied instance to be adopted (or torn down by the idle policy)",
    )


def test_release_quarantines_an_instance_with_leftover_processes(daemon: DaemonProcess) -> None:
    _check(daemon, "lease")


def test_the_job_exit_hook_release_quarantines_it_too(daemon: DaemonProcess) -> None:
    _check(daemon, "job")


def test_a_clean_release_reports_no_leftovers(daemon: DaemonProcess) -> None:
    daemon.simulate = "1xA100-40GB"
    daemon.start()
    client = daemon.client()
    lease = client.lease(job_id="ap#3.0#1", gpu_memory_mib=4000, mode="mig", wait_s=10)
    result = client.release(lease["lease_id"])
    assert result["state"] == "released"
    inst = _instance(client.status(), lease["gpu"], lease["mig_uuid"])
    assert inst is not None and not inst["busy"]
    # the next lease of that size gets the same instance: its hand-out check found nothing
    again = client.lease(job_id="ap#4.0#1", gpu_memory_mib=4000, mode="mig", wait_s=10)
    assert again["mig_uuid"] == lease["mig_uuid"]
    events = {e.get("event") for e in daemon.log_events()}
    assert not events & {"lease.leftover_processes", "lease.handout_refused"}
