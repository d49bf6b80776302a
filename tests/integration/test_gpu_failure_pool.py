"""A GPU fails under load in the multi-node pool (issue 15, GPU health, end to end).

Two execute nodes with migd from the .deb: ep1's only GPU fails (XID 79, injected with
migd's ``sim_xid`` op as root on ep1's socket) while a job runs on it and ep2's GPUs run
other jobs. What users and admins see: ep1's slot ads say ``MigdGpuHealthy = false`` with
the XID as ``MigdGpuReason``; the job on the failed GPU is stopped by the wrapper and goes
back to the queue (not held) with a reason naming the XID and the GPU, then completes on
ep2; ep2's jobs and a later wave all complete on ep2, and nothing new starts on ep1.

A module of its own (its own pool): the load in test_multinode_pool.py stays undisturbed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from condor_pool import CondorChroot, _log
from migd_packages import MIGD_PYTHON
from multinode import MultiNodePool, node_name

pytestmark = [pytest.mark.htcondor, pytest.mark.slow]

PY = MIGD_PYTHON
FAILED = "ep1"
NODES = {FAILED: "1xA100-40GB", "ep2": "2xA100-40GB"}
# The pool's /etc/condor/config.d (every node reads it): one slot ad per GPU from
# `condor-ad --per-gpu` (MigdGpuHealthy, MigdGpuReason), and faster checks than the
# shipped defaults (tests).
AP_CONFIG = """
MIGD_MAX_VRAM = 40448
STARTD_CRON_MIGD_PERIOD = 2
STARTD_CRON_MIGD_ARGS = condor-ad --watch --per-gpu --interval $(MIGD_AD_INTERVAL)
PERIODIC_EXPR_INTERVAL = 5
"""
# The job that meets the failure: long on its first run (the GPU fails under it), short
# once the wrapper has chirped the loss into its ad (the rerun), so the test stays fast.
VICTIM_JOB = """#!/bin/sh
echo "run on $(hostname) CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
if grep -q '^MigdGpuLosses' "$_CONDOR_JOB_AD"; then sleep 1; else sleep 120; fi
"""
OTHER_JOB = """#!/bin/sh
echo "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
sleep 6
"""
ON_EP2 = 'regexp("@ep2@", TARGET.Name)'


def job(script: str, **submit: str) -> dict[str, str]:
    desc = {
        "executable": script,
        "request_GPUs": "1",
        "request_VRAM": "4000",
        "request_cpus": "1",
    }
    desc.update(submit)
    return desc


@dataclass
class Failure:
    pool: MultiNodePool
    clusters: dict[str, int] = field(default_factory=dict)
    lease: dict[str, Any] = field(default_factory=dict)  # the victim's lease on ep1
    ep1_ads: list[dict[str, Any]] = field(default_factory=list)  # after the XID
    ads: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def failure(migd_installed: CondorChroot) -> Iterator[Failure]:
    multi = MultiNodePool(migd_installed, "gpufail")
    failed = True
    try:
        t0 = time.monotonic()
        multi.start(NODES, AP_CONFIG)
        ap = multi.ap
        ap.wait_for(
            lambda: (
                {node_name(ad.get("Name")) for ad in ap.status() if ad.get("MigdHealthy")}
                >= set(NODES)
            ),
            timeout=60,
            what="migd's ad on every node",
        )
        result = Failure(multi)
        ep1 = multi.nodes[FAILED]
        # Load: the victim prefers ep1 (its GPU fails under it), the others run on ep2.
        result.clusters["victim"] = ap.submit(
            job("victim.sh", rank=f'regexp("@{FAILED}@", TARGET.Name)'),
            files={"victim.sh": VICTIM_JOB},
        )
        result.clusters["others"] = ap.submit(
            job("other.sh", requirements=ON_EP2, queue="4"), files={"other.sh": OTHER_JOB}
        )
        [lease] = ap.wait_for(
            lambda: [x for x in ep1.leases() if x["state"] == "active"],
            timeout=60,
            what="the victim's lease active on ep1",
        )
        result.lease = lease
        t_xid = time.monotonic()
        migd_installed.run(
            [
                PY,
                "-c",
                "import sys; from migd.client import MigdClient; "
                "MigdClient(sys.argv[1]).call('sim_xid', gpu=0, xid=79)",
                ep1.socket,
            ]
        )
        # Out of service: ep1's slot ads say so (the per-GPU ad merged into its slots).
        result.ep1_ads = ap.wait_for(
            lambda: [
                ad
                for ad in ep1.slots()
                if ad.get("MigdGpuHealthy") is False and ad.get("MigdHealthy") is False
            ],
            timeout=30,
            what="ep1's slot ads to say its GPU is unhealthy",
        )
        result.seconds["ads"] = time.monotonic() - t_xid
        # A wave after the failure: every job must run on ep2.
        result.clusters["after"] = ap.submit(
            job("other.sh", queue="3"), files={"other.sh": OTHER_JOB}
        )
        for name, cluster in result.clusters.items():
            result.ads[name] = ap.wait(cluster, timeout=120)
        result.seconds["total"] = time.monotonic() - t0
        result.seconds["after_xid"] = time.monotonic() - t_xid
        _log(
            f"GPU failure scenario: {', '.join(f'{k} {v:.1f}s' for k, v in result.seconds.items())}"
        )
        yield result
        failed = False
    finally:
        if failed:
            print(multi.dump_logs())
        multi.stop()


def test_the_failed_gpu_is_taken_out_of_service(failure: Failure) -> None:
    assert failure.seconds["ads"] < 10, failure.seconds
    for ad in failure.ep1_ads:
        assert ad["MigdGpuHealthy"] is False and ad["MigdHealthy"] is False
        assert ad["MigdHealthyGpus"] == 0
        assert str(ad["MigdGpuReason"]).startswith("XID 79 (GPU has fallen off the bus) on GPU 0")
    status = failure.pool.nodes[FAILED].ctl("status", "--json")
    assert "XID 79" in status["gpus"][0]["health"]


def test_the_job_on_it_is_requeued_with_the_reason_and_completes_elsewhere(
    failure: Failure,
) -> None:
    pool = failure.pool
    cluster = failure.clusters["victim"]
    [ad] = failure.ads["victim"]
    assert ad["JobStatus"] == 4 and ad.get("ExitCode") == 0, ad  # completed, never held
    assert ad["NumJobStarts"] == 2, ad
    assert pool.node_of(ad) == "ep2"
    assert ad["MigdGpuLosses"] == 1
    assert str(ad["MigdGpuLostReason"]).startswith("GPU lost: XID 79 (GPU has fallen off")
    # Not counted as a start migd failed (the loop breaker holds only those).
    assert (ad.get("MigdStartFailures") or 0) == 0
    # What the user sees in the job's log: the eviction with migd's reason, naming the
    # XID and the failed GPU's UUID.
    log = pool.ap.user_log(cluster)
    assert "migd: GPU lost: XID 79" in log, log
    assert f"GPU {failure.lease['gpu_uuid']}" in log, log
    assert "Job was evicted" in log, log
    assert "goes back to the queue to run on a healthy GPU" in log, log
    # (the rerun's output and error files replaced the first run's)
    assert "run on" in pool.ap.job_output(cluster)


def test_the_other_gpus_keep_working_and_nothing_new_starts_on_the_failed_one(
    failure: Failure,
) -> None:
    for name in ("others", "after"):
        ads = failure.ads[name]
        assert len(ads) == (4 if name == "others" else 3)
        for ad in ads:
            assert ad["JobStatus"] == 4 and ad.get("ExitCode") == 0, ad
            assert failure.pool.node_of(ad) == "ep2", ad
    # ep1's migd granted no lease after the victim's (the only one it ever had).
    every = failure.pool.nodes[FAILED].leases(all_leases=True)
    assert [x["lease_id"] for x in every] == [failure.lease["lease_id"]], every
    for node in failure.pool.nodes.values():
        assert node.leases() == [], node.name  # nothing leaks
    assert failure.seconds["after_xid"] < 60, failure.seconds


def xid(pool: MultiNodePool, node: str, gpu: int) -> None:
    """An XID 79 on one of ``node``'s GPUs, injected as root on its socket."""
    pool.chroot.run(
        [
            PY,
            "-c",
            "import sys; from migd.client import MigdClient; "
            "MigdClient(sys.argv[1]).call('sim_xid', gpu=int(sys.argv[2]), xid=79)",
            pool.nodes[node].socket,
            str(gpu),
        ]
    )


def test_a_failed_gpu_beside_healthy_ones_gets_no_new_jobs_and_comes_back_on_resume(
    failure: Failure,
) -> None:
    """ep2 keeps a healthy GPU beside the failed one, so its slot still matches: migd takes
    the failed GPU's shares offline in the startd (the shipped config includes its file,
    condor_reconfig), and HTCondor gives every new job a share of the healthy GPU. Runs
    last: it fails one of ep2's GPUs."""
    pool = failure.pool
    ep2 = pool.nodes["ep2"]
    status = ep2.ctl("status", "--json")
    failed_uuid = status["gpus"][0]["uuid"]
    short = failed_uuid.split("-")[1]
    failed_ids = {f"GPU-s{n:02d}-{short}" for n in range(7)}

    def pslot() -> dict[str, Any]:
        [ad] = [ad for ad in ep2.slots() if ad.get("PartitionableSlot")]
        return ad

    total = pslot()["TotalSlotGPUs"]
    assert total == 14  # two GPUs of 7 shares
    before = {x["lease_id"] for x in ep2.leases(all_leases=True)}
    t_xid = time.monotonic()
    xid(pool, "ep2", 0)
    offline = pool.ap.wait_for(
        lambda: (ad := pslot()).get("OfflineGPUs") and ad,
        timeout=30,
        what="the failed GPU's shares offline in ep2's slot ad",
    )
    _log(f"ep2's failed GPU offline in the collector {time.monotonic() - t_xid:.1f}s after the XID")
    assert {i.strip() for i in str(offline["OfflineGPUs"]).split(",")} == failed_ids, offline
    # A wave on ep2 only: every job gets the healthy GPU.
    cluster = pool.ap.submit(
        job("other.sh", requirements=ON_EP2, queue="4"), files={"other.sh": OTHER_JOB}
    )
    ads = pool.ap.wait(cluster, timeout=120)
    assert [ad["JobStatus"] for ad in ads] == [4] * 4, ads
    wave = [x for x in ep2.leases(all_leases=True) if x["lease_id"] not in before]
    assert len(wave) == 4, wave
    assert {x["gpu_uuid"] for x in wave} == {status["gpus"][1]["uuid"]}, wave
    # Back in service: resume clears migd's condition and the startd's offline list.
    t_resume = time.monotonic()
    ep2.ctl("resume", "0")
    back = pool.ap.wait_for(
        lambda: not (ad := pslot()).get("OfflineGPUs") and ad,
        timeout=30,
        what="the shares back in ep2's slot ad",
    )
    _log(f"ep2's GPU back in the collector {time.monotonic() - t_resume:.1f}s after resume")
    assert back["TotalSlotGPUs"] == total
    assert "condor.offline_gpus" in ep2.migd_log()
