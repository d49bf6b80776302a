"""The hybrid MIG+MPS policy through a real HTCondor 23.9 pool.

migd (installed from this tree's packages, as in ``test_migd_condor``) runs on one
simulated A100-40GB with ``mode = "hybrid"``: one user's small jobs, opted in with
``+MigdMode = "mps"`` (docs/configuration.md), run at once as pinned MPS shares inside
one MIG instance, a big job gets a MIG instance of its own, and all of them exit 0.

One GPU, because HTCondor, not migd, picks the GPU of a job on a node's one partitionable
slot: it hands out the GPU shares sorted, so a user's jobs go round-robin over the GPUs
(docs/htcondor-notes.md) and on two GPUs the same three jobs run in one host per GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from condor_pool import CondorChroot, PersonalPool
from test_migd_condor import Migd, gpu_pool, installed, migd_slots, simjob

__all__ = ["installed"]  # a fixture, used by name below

HYBRID_TOML = """version = 1
[api]
lease_users = ["*"]
[reaper]
interval_s = 1.0
[[gpu]]
match = "*"
mode = "hybrid"
share = "either"
"""
SMALL_MIB = 3000
BIG_MIB = 15000
SMALL_JOBS = 3


@pytest.fixture
def hybrid_migd(installed: CondorChroot) -> Iterator[Migd]:
    """migd on an A100-40GB with the hybrid policy."""
    daemon = Migd(installed, "1xA100-40GB", settings=[], config=HYBRID_TOML)
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        print(daemon.log()[-20000:])


def job_env(pool: PersonalPool, cluster: int, proc: int) -> dict[str, str]:
    out = pool.job_output(cluster, proc)
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_small_jobs_share_one_mig_instance_and_a_big_one_gets_its_own(
    hybrid_migd: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    pool = gpu_pool(personal_pool)
    migd_slots(pool)
    # long enough that all of them run at once (the cron ad and matching take seconds)
    run = ("--print-env", "--start", "1G", "--steps", "40", "--step-s", "0.5")
    small = pool.submit({**simjob(SMALL_MIB, *run), "+MigdMode": '"mps"', "queue": str(SMALL_JOBS)})
    big = pool.submit(simjob(BIG_MIB, *run))

    def all_running() -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
        ads = pool.q(small) + pool.q(big)
        if len(ads) != SMALL_JOBS + 1 or any(ad.get("JobStatus") != 2 for ad in ads):
            return None
        leases = [x for x in hybrid_migd.leases() if x["state"] == "active"]
        if {ad["GlobalJobId"] for ad in ads} <= {x["job_id"] for x in leases}:
            return ads, leases
        return None

    ads, leases = Migd.wait_for(all_running, "the four jobs to run with a lease", timeout_s=150)
    by_job = {x["job_id"]: x for x in leases}
    small_leases = [by_job[ad["GlobalJobId"]] for ad in ads if ad["ClusterId"] == small]
    [big_lease] = [by_job[ad["GlobalJobId"]] for ad in ads if ad["ClusterId"] == big]

    # the small ones: MPS shares, all in one MIG instance (one user, one server)
    assert [x["mode"] for x in small_leases] == ["mps"] * SMALL_JOBS
    hosts = {x["mig_uuid"] for x in small_leases}
    assert len(hosts) == 1 and next(iter(hosts)).startswith("MIG-")
    status = hybrid_migd.ctl("status", "--json")
    [host] = [i for g in status["gpus"] for i in g["instances"] if i["uuid"] in hosts]
    shares = host["mps"]["shares"]
    assert {s["lease_id"] for s in shares} == {x["lease_id"] for x in small_leases}
    assert {s["pinned_mib"] for s in shares} == {SMALL_MIB}
    # the big one: a MIG instance of its own, no MPS server in it
    assert big_lease["mode"] == "mig" and big_lease["mig_uuid"] not in hosts
    [own] = [
        i for g in status["gpus"] for i in g["instances"] if i["uuid"] == big_lease["mig_uuid"]
    ]
    assert "mps" not in own and own["memory_mib"] >= BIG_MIB
    explain = hybrid_migd.ctl("explain", small_leases[0]["job_id"])
    assert explain is not None and "why: hybrid: opted in to sharing" in explain

    for ad in pool.wait(small, timeout=180):
        assert ad["ExitCode"] == 0, pool.job_error(small, ad["ProcId"])
        env = job_env(pool, small, ad["ProcId"])
        # what the job's CUDA sees: its pinned limit and the host's server
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={SMALL_MIB}M"
        assert env["CUDA_VISIBLE_DEVICES"] in hosts
        assert env["CUDA_MPS_PIPE_DIRECTORY"]
    [done] = pool.wait(big, timeout=180)
    assert done["ExitCode"] == 0, pool.job_error(big)
    env = job_env(pool, big, 0)
    assert env["CUDA_VISIBLE_DEVICES"] == big_lease["mig_uuid"]
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env
    # every lease released; the emptied host was destroyed with its server
    Migd.wait_for(lambda: hybrid_migd.leases() == [], "the leases to be released")
    Migd.wait_for(
        lambda: (
            not [
                i
                for g in hybrid_migd.ctl("status", "--json")["gpus"]
                for i in g["instances"]
                if i["uuid"] in hosts
            ]
        ),
        "the emptied host to be destroyed",
    )
