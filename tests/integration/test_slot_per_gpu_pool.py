"""One partitionable slot per GPU in a real HTCondor 23.9 pool (issue 22 §7, htcondor-notes (t)).

With one partitionable slot for the node, ``VRAM`` is one pool and the startd gives each
dynamic slot the first free GPU share, so two whole-GPU claims could both sit on GPU 0 and
claim reuse kept the user's later jobs waiting there while GPU 1 idled. The shipped
``10-migd-execute.config`` with ``MIGD_SLOT_PER_GPU = true`` (``migctl condor-slots``) gives
each GPU its own partitionable slot with its own shares and ``VRAM``: a wave of whole-GPU jobs from
one user must keep both GPUs busy at once, and no job may wait on a busy GPU while the other
one is free.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from condor_pool import PersonalPool
from test_migd_condor import (
    A100_FULL_MIB,
    Migd,
    gpu_pool,
    installed,
    migd,
    migd_slots,
    simjob,
)

from migd.core.condor_shares import physical_gpu, short_uuid

__all__ = ["installed", "migd"]  # fixtures, used by name below

JOBS = 6
# Longer than a negotiation cycle plus the wrapper's start, so that claims are reused.
JOB_S = 8.0
# A job may run briefly without a lease while its wrapper starts or the previous job's
# partition is given back; what (t) showed was a job waiting ~109 s beside an idle GPU.
IDLE_BESIDE_WAITING_LIMIT_S = 20.0


# What an admin adds to /etc/condor/config.d to turn it on (10-migd-execute.config's comment).
PER_GPU = (
    "MIGD_SLOT_PER_GPU = true\n"
    "include command : $(MIGD_BIN)/migctl condor-slots --shares $(MIGD_SHARES_PER_GPU)\n"
)


def test_whole_gpu_wave_keeps_both_gpus_busy_with_one_slot_per_gpu(
    migd: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    # set after the drop-in, in /etc/condor/config.d, as an admin would
    pool = gpu_pool(personal_pool, PER_GPU)
    migd_slots(pool)
    gpus = sorted(g["uuid"] for g in migd.ctl("status", "--json")["gpus"])
    assert len(gpus) == 2

    # condor_status: one partitionable slot per GPU, each with that GPU's shares and VRAM
    pslots = Migd.wait_for(
        lambda: (
            [
                ad
                for ad in pool.status()
                if ad.get("PartitionableSlot") and ad.get("MigdHealthy") is True
            ]
            or None
        ),
        "the partitionable slots in the collector",
    )
    assert len(pslots) == 2, pslots
    owners = []
    for ad in pslots:
        assert ad["TotalSlotVRAM"] == A100_FULL_MIB, ad
        assert ad["VRAM"] == A100_FULL_MIB, ad
        assert ad["TotalSlotGPUs"] == 7, ad
        shares = [s.strip() for s in str(ad["AssignedGPUs"]).split(",")]
        [owner] = {physical_gpu(s) for s in shares}
        owners.append(owner)
        # START tests the slot's own GPU (condor-ad --per-gpu merged its GPU's ad)
        assert ad["MigdGpuLargestPlaceableMB"] == A100_FULL_MIB, ad
    assert sorted(owners) == sorted(short_uuid(g) for g in gpus)

    steps = int(JOB_S / 0.5)
    cluster = pool.submit(
        {
            **simjob(A100_FULL_MIB, "--start", "30G", "--steps", str(steps), "--step-s", "0.5"),
            "queue": str(JOBS),
        }
    )

    # Sample the queue and migd's leases while the wave runs.
    most_at_once = 0
    idle_beside_waiting_since: float | None = None
    longest_idle_beside_waiting = 0.0
    deadline = time.monotonic() + 400
    while True:
        queue = pool.q(cluster)
        if not queue:
            break
        assert time.monotonic() < deadline, f"the wave did not finish: {queue}"
        assert all(ad.get("JobStatus") != 5 for ad in queue), queue
        active = [x for x in migd.leases() if x["state"] == "active"]
        busy = {x["gpu_uuid"] for x in active}
        most_at_once = max(most_at_once, len(busy))
        with_lease = {x["job_id"] for x in active}
        waiting = [
            ad for ad in queue if ad.get("JobStatus") == 2 and ad["GlobalJobId"] not in with_lease
        ]
        idle_jobs = [ad for ad in queue if ad.get("JobStatus") == 1]
        now = time.monotonic()
        if (waiting or idle_jobs) and len(busy) < 2:
            idle_beside_waiting_since = idle_beside_waiting_since or now
            longest_idle_beside_waiting = max(
                longest_idle_beside_waiting, now - idle_beside_waiting_since
            )
        else:
            idle_beside_waiting_since = None
        time.sleep(0.5)

    ads = pool.history(cluster)
    assert len(ads) == JOBS and all(ad["ExitCode"] == 0 for ad in ads), ads
    assert most_at_once == 2, "the two GPUs never ran whole-GPU jobs at once"
    used = {}
    for ad in ads:
        [lease] = [x for x in migd.job_leases(ad["GlobalJobId"]) if x.get("gpu_uuid")][:1]
        used[ad["ProcId"]] = lease["gpu_uuid"]
        err = pool.job_error(cluster, ad["ProcId"])
        assert "could serve it now" not in err, err
    assert set(used.values()) == set(gpus), used
    assert longest_idle_beside_waiting < IDLE_BESIDE_WAITING_LIMIT_S, (
        f"a GPU idled {longest_idle_beside_waiting:.1f} s while a job waited",
        used,
    )
    print(
        f"wave of {JOBS} x {JOB_S:.0f} s whole-GPU jobs: GPUs {used}; longest time a GPU "
        f"idled beside a waiting job {longest_idle_beside_waiting:.1f} s"
    )


def test_a_several_gpu_job_gets_shares_of_one_gpu_with_one_slot_per_gpu(
    migd: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    """The price that keeps ``MIGD_SLOT_PER_GPU`` off by default: a dynamic slot is carved
    from one GPU's slot, so ``request_GPUs = 2`` gets two shares of the same GPU (two
    partitions there; a job that needs two whole GPUs could never be served)."""
    pool = gpu_pool(personal_pool, PER_GPU)
    migd_slots(pool)
    job = simjob(4000, "--start", "1G", "--steps", "1", request_GPUs="2")
    cluster = pool.submit({**job, "job_machine_attrs": "AssignedGPUs"})
    [ad] = pool.wait(cluster, timeout=180)
    assert ad["ExitCode"] == 0, pool.job_error(cluster)
    assigned = [s.strip() for s in str(ad["MachineAttrAssignedGPUs0"]).split(",")]
    assert len(assigned) == 2 and len({physical_gpu(s) for s in assigned}) == 1, assigned
    leases = migd.job_leases(ad["GlobalJobId"])
    assert len(leases) == 2 and len({x["gpu_uuid"] for x in leases}) == 1, leases
