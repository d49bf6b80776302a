"""Job shapes in a real HTCondor 23.9 pool (issue 22): what users see in condor_q/condor_history.

- ``+MigdMode`` requests match only GPUs that serve the mode and land there (an A100 in
  MIG mode beside a V100 that migd shares with MPS), first start, no refusals;
- the slot ad carries ``GPUs_NvidiaDriver`` (the 25.14 starter passes ``--nv`` to
  Apptainer only then; the container command line itself is checked in
  tests/process/test_container_jobs.py: no container runtime here);
- docker-universe and interactive GPU jobs are held at once with a reason that says
  what to do (``+InteractiveJob = true`` is what ``condor_submit -i`` sets; a real
  ``-i`` needs an ssh session the harness does not have);
- the access point's MIGD_MAX_VRAM / served modes come from the pool: a job that states
  no GPU memory runs on a 40 GB node, one that asks for more than any node has, or for a
  mode no node serves, is held with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from condor_pool import CondorChroot, PersonalPool
from test_condor_gpu_language import long_job, mixed_migd
from test_migd_condor import (
    A100_FULL_MIB,
    Migd,
    gpu_pool,
    installed,
    migd,
    migd_slots,
    shipped_config,
    simjob,
)

__all__ = ["installed", "migd", "mixed_migd"]  # fixtures, used by name below


def test_mode_requests_land_on_a_gpu_that_serves_the_mode(
    mixed_migd: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    pool = gpu_pool(personal_pool)
    slots = migd_slots(pool)
    # what condor_gpu_discovery -properties publishes since 24.5.1, read by the 25.14 starter
    [driver] = {ad.get("GPUs_NvidiaDriver") for ad in slots if "AvailableGPUs" in ad}
    assert isinstance(driver, str) and driver, slots[0]
    assert {ad.get("MigdServes") for ad in slots} == {"mig,mps"}
    # Two MPS jobs and one MIG job at once, no capability terms: before the MIGDMODE
    # transform HTCondor gave the first free share, often the A100's, and migd refused.
    mps = pool.submit({**long_job(), "request_VRAM": "2000", "+MigdMode": '"mps"', "queue": "2"})
    mig = pool.submit({**long_job(), "request_VRAM": "2000", "+MigdMode": '"mig"'})

    def running() -> list[dict[str, Any]] | None:
        ads = pool.q(mps) + pool.q(mig)
        if len(ads) == 3 and all(ad.get("JobStatus") == 2 for ad in ads):
            active = {x["job_id"] for x in mixed_migd.leases() if x["state"] == "active"}
            if {ad["GlobalJobId"] for ad in ads} <= active:
                return ads
        return None

    ads = Migd.wait_for(running, "the three mode jobs to run with a lease", timeout_s=150)
    gpus = {g["uuid"]: g for g in mixed_migd.ctl("status", "--json")["gpus"]}
    by_job = {x["job_id"]: x for x in mixed_migd.leases()}
    for ad in ads:
        lease = by_job[ad["GlobalJobId"]]
        want = "mps" if ad["ClusterId"] == mps else "mig"
        model = "V100" if want == "mps" else "A100"
        assert lease["mode"] == want and model in gpus[lease["gpu_uuid"]]["model"], lease
        # the job's RequireGPUs steered the share HTCondor assigned
        assert ad["MigdModePolicy"] is True and "MigdServes" in str(ad["RequireGPUs"])
        # matched where served: no refused start on the way (the queue's NumJobStarts
        # lags the start, so migd's own books count the tries: one lease, granted)
        assert (ad.get("NumJobStarts") or 0) <= 1 and (ad.get("MigdStartFailures") or 0) == 0
        assert len(mixed_migd.job_leases(ad["GlobalJobId"])) == 1
    for cluster in (mps, mig):
        pool.rm(cluster)


def _held(pool: PersonalPool, cluster: int) -> dict[str, Any]:
    [ad] = pool.wait(
        cluster, timeout=90, until=lambda ads: bool(ads) and ads[0].get("JobStatus") == 5
    )
    return ad


def test_docker_and_interactive_gpu_jobs_are_held_with_what_to_do(
    installed: CondorChroot, personal_pool: Callable[..., PersonalPool]
) -> None:
    pool = gpu_pool(personal_pool)
    docker = pool.submit(
        {
            "universe": "docker",
            "docker_image": "nvidia/cuda:12.4.0-base-ubuntu22.04",
            "executable": "/bin/true",
            "request_GPUs": "1",
            "request_cpus": "1",
        }
    )
    interactive = pool.submit(
        {
            "executable": "/bin/sleep",
            "arguments": "60",
            "request_GPUs": "1",
            "+InteractiveJob": "true",
        }
    )
    # the same shapes without a GPU are none of migd's business
    plain = pool.submit({"executable": "/bin/true", "+InteractiveJob": "true"})
    ad = _held(pool, docker)
    assert ad["HoldReasonSubCode"] == 89 and ad.get("NumJobStarts", 0) == 0
    assert "docker-universe GPU jobs are not served" in ad["HoldReason"]
    assert "Apptainer" in ad["HoldReason"]  # what to do instead
    ad = _held(pool, interactive)
    assert ad["HoldReasonSubCode"] == 90 and ad.get("NumJobStarts", 0) == 0
    assert "interactive GPU jobs are not served" in ad["HoldReason"]
    [done] = pool.wait(plain, timeout=90)
    assert done["ExitCode"] == 0 and done.get("HoldReasonSubCode") is None
    pool.rm(docker)
    pool.rm(interactive)


def test_access_point_defaults_come_from_the_pool(
    installed: CondorChroot, personal_pool: Callable[..., PersonalPool]
) -> None:
    # One 40 GB A100 and no MIGD_MAX_VRAM set by an admin: the shipped 81920 would give a
    # job without a memory statement a size no node has, and it would sit Idle forever.
    defaults_file = "/var/lib/condor/migd-pool-defaults.config"  # MIGD_POOL_DEFAULTS_FILE
    installed.run(["rm", "-f", defaults_file])  # none left by an earlier pool in this chroot
    daemon = Migd(installed, "1xA100-40GB")
    daemon.start()
    try:
        pool = personal_pool("STARTD_CRON_MIGD_PERIOD = 2\nSCHEDD_CRON_MIGDPOOL_PERIOD = 5\n")
        migd_slots(pool)

        def learned() -> bool:
            proc = pool.condor(["condor_config_val", "-schedd", "MIGD_MAX_VRAM"], check=False)
            return proc.stdout.strip() == str(A100_FULL_MIB)

        Migd.wait_for(learned, "the schedd to take MIGD_MAX_VRAM from the pool", timeout_s=90)
        # the cron job's output is in the schedd's ad (the collector's copy may lag)
        schedd = Migd.wait_for(
            lambda: [ad for ad in pool.status("-schedd") if "MigdPoolMaxVRAM" in ad],
            "MigdPoolMaxVRAM in the schedd's ad",
            timeout_s=30,
        )[0]
        assert schedd["MigdPoolMaxVRAM"] == A100_FULL_MIB and schedd["MigdPoolModes"] == "mig"
        unstated = simjob(0, "--start", "1G", "--steps", "2")
        del unstated["request_VRAM"]
        plain = pool.submit(unstated)
        too_big = pool.submit(simjob(50_000, "--start", "1G"))
        mps = pool.submit({**simjob(2000, "--start", "1G"), "+MigdMode": '"mps"'})
        [ad] = pool.wait(plain, timeout=180)
        assert ad["ExitCode"] == 0, pool.job_error(plain)
        assert (ad["MigdVRAMSource"], ad["RequestVRAM"]) == ("MIGD_DEFAULT_VRAM", A100_FULL_MIB)
        ad = _held(pool, too_big)
        assert ad["HoldReasonSubCode"] == 88
        assert f"largest GPU partition in this pool ({A100_FULL_MIB} MiB)" in ad["HoldReason"]
        ad = _held(pool, mps)
        assert ad["HoldReasonSubCode"] == 91, ad["HoldReason"]
        assert "no GPU in this pool serves MigdMode = mps (served: mig)" in ad["HoldReason"], ad
        assert f"MIGD_POOL_MAX_VRAM = {A100_FULL_MIB}" in installed.read_file(defaults_file)
        for cluster in (too_big, mps):
            pool.rm(cluster)
    finally:
        installed.run(["rm", "-f", defaults_file])
        daemon.stop()
        print(daemon.log()[-20000:])


def _transform(chroot: CondorChroot, job_ad: str) -> dict[str, str]:
    """The access point's job transforms (MIGD, MIGDMODE) applied by HTCondor's own
    condor_transform_ads to ``job_ad``: attribute -> expression text."""
    chroot.write_file("/tmp/migd-shapes/ap.config", shipped_config("20-migd-access-point.config"))
    chroot.write_file(
        "/tmp/migd-shapes/condor_config",
        "LOCAL_CONFIG_DIR =\nLOCAL_CONFIG_FILE = /tmp/migd-shapes/ap.config\nSPOOL = /tmp\n",
    )
    chroot.write_file("/tmp/migd-shapes/job.ad", job_ad)
    proc = chroot.run(
        [
            "condor_transform_ads",
            "-jobtransforms",
            "MIGD,MIGDMODE",
            "-in",
            "/tmp/migd-shapes/job.ad",
        ],
        env={"CONDOR_CONFIG": "/tmp/migd-shapes/condor_config"},
        check=False,  # 23.9.6 exits 1 after printing the transformed ads, even for one SET rule
    )
    assert "ClusterId" in proc.stdout, proc.stderr
    return {
        k.strip(): v.strip()
        for k, _, v in (x.partition("=") for x in proc.stdout.splitlines())
        if v
    }


JOB_AD = """ClusterId = 1
ProcId = 0
RequestGPUs = 1
RequestVRAM = 2000
Requirements = (TARGET.GPUs >= RequestGPUs) && (TARGET.VRAM >= RequestVRAM)
"""


def test_the_mode_transform_as_htcondor_applies_it(condor_chroot: CondorChroot) -> None:
    ad = _transform(condor_chroot, JOB_AD + 'MigdMode = "mps"\n')
    assert ad["RequireGPUs"] == '(true) && stringListIMember("mps",MigdServes ?: "")'
    assert ad["Requirements"].endswith(
        "(countMatches(MY.RequireGPUs,TARGET.AvailableGPUs) >= RequestGPUs)"
    )
    # the job's own require_gpus is kept
    ad = _transform(condor_chroot, JOB_AD + 'MigdMode = "mig"\nRequireGPUs = Capability >= 8.0\n')
    assert ad["RequireGPUs"] == '(Capability >= 8.0) && stringListIMember("mig",MigdServes ?: "")'
    # auto, or no mode: untouched
    for extra in ('MigdMode = "auto"\n', ""):
        ad = _transform(condor_chroot, JOB_AD + extra)
        assert "RequireGPUs" not in ad and "MigdModePolicy" not in ad
        assert "countMatches" not in ad["Requirements"]
