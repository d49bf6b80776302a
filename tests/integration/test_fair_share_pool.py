"""Fair share by GPU memory, and GPU memory requests rounded to the profile ladder.

The shipped SLOT_WEIGHT charges a slice its share of its GPU:
A real HTCondor 23.9 pool with migd on four simulated A100-40GB and the shipped
``condor_config/`` files. Two accounting principals run at once: one with two whole-GPU
jobs, one with two jobs on 1g.5gb slices. With HTCondor's default ``SLOT_WEIGHT = Cpus``
both (two one-core jobs each) would be charged the same; with migd's weight the whole-GPU
user is charged about eight times more, and ``condor_userprio``'s priorities move that
way. The access point's transform rounds each RequestVRAM up to the
ladder and keeps the asked value in MigdRequestedVRAM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import classad2
import pytest
from condor_pool import CondorChroot, PersonalPool
from test_migd_condor import A100_FULL_MIB, Migd, gpu_pool, installed, migd_slots, simjob

__all__ = ["installed"]  # fixture, used by name below

SMALL_MIB = 4864  # a 1g.5gb's memory on an A100-40GB
# Priorities follow usage within seconds instead of a day; accountant updated every cycle.
FAST_ACCOUNTING = """
PRIORITY_HALFLIFE = 10
NEGOTIATOR_INTERVAL = 2
"""


@pytest.fixture
def four_a100(installed: CondorChroot) -> Iterator[Migd]:
    daemon = Migd(installed, "4xA100-40GB")
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()


def _job(memory_mib: int, group_user: str, count: int) -> dict[str, str]:
    # long enough to be running while priorities move; removed at the end
    job = simjob(memory_mib, "--start", "100M", "--steps", "600", "--step-s", "0.5")
    job.update(
        {
            "accounting_group": "gpu",
            "accounting_group_user": group_user,
            "+MigdMode": '"mig"',
            "queue": str(count),
        }
    )
    return job


def _accounting(pool: PersonalPool) -> dict[str, dict[str, Any]]:
    """The negotiator's accounting records (``condor_userprio -all -long``) by submitter
    name prefix (``gpu.small``, ``gpu.whole``); 23.9's condor_status has no -accounting."""
    out = pool.condor(["condor_userprio", "-all", "-long"], check=False).stdout
    records: dict[str, dict[str, Any]] = {}
    for block in out.split("\n\n"):
        ad = classad2.parseOne(block) if block.strip() else None
        if ad is not None and "Name" in ad:
            records[str(ad["Name"]).split("@")[0]] = {k: ad.eval(k) for k in ad}
    return records


def test_a_slice_costs_its_share_of_a_gpu_and_priorities_follow(
    four_a100: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    pool = gpu_pool(personal_pool, FAST_ACCOUNTING)
    migd_slots(pool)
    # The whole-GPU jobs first: HTCondor hands out the first free share ID in sorted order
    # (s00 of each GPU), so they get GPUs 0 and 1 and the slices GPUs 2 and 3.
    whole = pool.submit(_job(A100_FULL_MIB, "whole", 2))
    small = None
    try:

        def claimed(n: int) -> list[dict[str, Any]]:
            def running() -> list[dict[str, Any]] | None:
                ads = pool.startd_ads()
                busy = [
                    a for a in ads if a.get("DynamicSlot") is True and a.get("State") == "Claimed"
                ]
                return ads if len(busy) >= n else None

            ads: list[dict[str, Any]] = Migd.wait_for(running, f"{n} jobs running", timeout_s=180)
            return ads

        claimed(2)
        small = pool.submit(_job(SMALL_MIB, "small", 2))
        claimed(4)
        share = round(SMALL_MIB / A100_FULL_MIB, 3)

        def weights() -> list[float] | None:
            # SlotWeight is an expression in the ad: -af evaluates it in the slot ad
            cmd = ["condor_status", "-af", "SlotWeight", "-constraint", "DynamicSlot =?= true"]
            out = pool.condor(cmd, check=False).stdout.split()
            return sorted(round(float(x), 3) for x in out) if len(out) == 4 else None

        assert Migd.wait_for(weights, "four dynamic slots' weights") == [share, share, 1.0, 1.0]

        def real(ad: dict[str, Any]) -> float:
            return float(ad["Priority"]) / float(ad.get("PriorityFactor") or 1.0)

        def settled() -> dict[str, dict[str, Any]] | None:
            acc = _accounting(pool)
            s, w = acc.get("gpu.small"), acc.get("gpu.whole")
            if not s or not w or real(w) < 1.5:  # converging on 2 whole GPUs
                return None
            return acc

        acc = Migd.wait_for(
            settled,
            "the whole-GPU user's real priority to reach 1.5 (half-life 10 s)",
            timeout_s=180,
        )
        s, w = acc["gpu.small"], acc["gpu.whole"]
        # the same count of slots; weighted 2 x 0.12 against 2 x 1
        assert s["ResourcesUsed"] == 2 and w["ResourcesUsed"] == 2
        assert float(s["WeightedResourcesUsed"]) == pytest.approx(2 * share, rel=0.02)
        assert float(w["WeightedResourcesUsed"]) == pytest.approx(2.0, rel=0.02)
        # a lower number is a better priority: the slice user is ahead
        assert real(s) < real(w) / 2, (s, w)
    finally:
        pool.rm(whole)
        if small is not None:
            pool.rm(small)


def test_the_access_point_rounds_gpu_memory_to_the_ladder_and_keeps_the_ask(
    four_a100: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    # On in this pool (off by default: it would inflate MPS shares, see the config's comment)
    pool = gpu_pool(personal_pool, "MIGD_ROUND_VRAM = true\n")
    asks = {"3000": 4864, "4864": 4864, "12000": 16384, "40000": 40192, "100000": 100000}
    clusters = {
        ask: pool.submit({**simjob(int(ask), "--steps", "1"), "hold": "true"}) for ask in asks
    }
    for ask, cluster in clusters.items():
        [ad] = pool.q(cluster, attrs=["RequestVRAM", "MigdRequestedVRAM"])
        assert (ad["RequestVRAM"], ad["MigdRequestedVRAM"]) == (asks[ask], int(ask)), ad
    # a request above MIGD_MAX_VRAM is not rounded (it is held as too big, with its size)
    # and a rounded one runs on a partition that fits it
    pool.release(clusters["3000"])
    [done] = pool.wait(clusters["3000"], timeout=120)
    assert done["ExitCode"] == 0, pool.job_error(clusters["3000"])
