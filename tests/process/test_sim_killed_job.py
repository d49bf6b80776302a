"""A fake CUDA job killed by a signal frees its simulated GPU memory (issue 21 §4), end to
end: the real daemon and wrapper, the job SIGKILLed (as ``condor_rm`` or a vacate ends
it). migd's leftover check after the release (the sampler's round or the next hand-out)
then finds nothing on the instance, so it is not quarantined and the next job gets it;
before the simulator freed a dead
process's memory, every such kill left the instance unexplained until migd restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from tests.process.conftest import DaemonProcess, wait_for

SIMJOB = [sys.executable, "-m", "migd.backends.simulated.cuda_job"]
LONG_S = 60.0


def migd_run(daemon: DaemonProcess, job_id: str, *job: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "migd.wrapper.main", "--socket", str(daemon.socket_path),
         "--gpu-memory", "4G", "--job-id", job_id, "--", *SIMJOB, *job],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "MIGD_API_SOCKET": str(daemon.socket_path)},
    )  # fmt: skip


def test_a_killed_jobs_instance_is_free_for_the_next_job(daemon: DaemonProcess) -> None:
    daemon.start()
    client = daemon.client()
    wrapper = migd_run(daemon, "killed.0", "--start", "3G", "--steps", "100000", "--step-s", "0.1")
    try:
        [lease] = wait_for(
            lambda: [x for x in client.call("leases")["leases"] if x["state"] == "active"],
            LONG_S,
            "the job's lease to be active",
        )
        wait_for(
            lambda: (
                (client.call("usage", lease_id=lease["lease_id"]).get("device_used_mib") or 0)
                >= 3072
            ),
            LONG_S,
            "the job's 3 GiB on its instance",
        )
        [job] = psutil.Process(wrapper.pid).children()
        job.send_signal(signal.SIGKILL)  # no cudaFree, no detach: the process is just gone
        _, stderr = wrapper.communicate(timeout=LONG_S)
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.communicate()
    assert wrapper.returncode == -signal.SIGKILL, stderr
    status = client.status()
    [inst] = [
        i for i in status["gpus"][lease["gpu"]]["instances"] if i["uuid"] == lease["mig_uuid"]
    ]
    assert inst["origin"] != "unexplained" and not inst["busy"], inst
    # The next job of the same size runs on that very instance.
    after = migd_run(daemon, "next.0", "--start", "3G", "--steps", "1", "--step-s", "0.01")
    _, stderr = after.communicate(timeout=LONG_S)
    assert after.returncode == 0, stderr
    [mine] = [x for x in client.call("leases", all=True)["leases"] if x["job_id"] == "next.0"]
    assert mine["mig_uuid"] == lease["mig_uuid"]
