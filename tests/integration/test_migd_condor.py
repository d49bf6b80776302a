"""migd through a real HTCondor 23.9 pool: wrapper, hook, cron ad and the OOM policy.

migd is installed in the trixie chroot from this tree's ``.deb`` packages (``migd``,
``migd-ep``, ``migd-ap``: the HTCondor configuration comes from their drop-ins in
``/usr/share/condor/config.d``, unchanged but for documented knobs) and runs on
simulated GPUs (2 x A100-40GB); jobs are submitted by a non-root user and run fake CUDA programs
(``migd.backends.simulated.cuda_job``) that allocate on their partition through migd.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from condor_pool import CondorChroot, PersonalPool
from migd_packages import MIGD_PYTHON

from migd.backends.simulated.hardware import MIG_IDLE_USED_MIB
from migd.core.condor_shares import physical_gpu

REPO = Path(__file__).resolve().parents[2]
PY = MIGD_PYTHON  # the packaged migd's interpreter (conftest.install_migd)
SOCKET = "/run/migd/migd.sock"
A100_FULL_MIB = 40448


def shipped_config(name: str) -> str:
    return (REPO / "condor_config" / name).read_text()


# What an admin sets in /etc/condor/config.d: the pool's largest partition, and (tests only)
# a faster cron than the shipped 30 s.
POOL_CONFIG = f"""
MIGD_MAX_VRAM = {A100_FULL_MIB}
STARTD_CRON_MIGD_PERIOD = 2
"""


class Migd:
    """The daemon inside the chroot, started and stopped by the tests.

    Args:
        chroot: the chroot with migd installed.
        simulate: the simulated GPUs (``--simulate``).
        settings: ``--set`` overrides; ``None``: the ones these tests use.
        config: a migd.toml for ``--config`` (written to :attr:`CONFIG`), if any.
    """

    CONFIG = "/etc/migd/test.toml"

    def __init__(
        self,
        chroot: CondorChroot,
        simulate: str = "2xA100-40GB",
        settings: Sequence[str] | None = None,
        config: str | None = None,
    ) -> None:
        self.chroot = chroot
        self.proc: subprocess.Popen[bytes] | None = None
        self.reaper_interval_s = 1.0
        self.simulate = simulate
        self.settings = settings
        self.config = config

    def start(self) -> None:
        self.chroot.run(["rm", "-rf", "/var/lib/migd", "/run/migd"], check=False)
        self.chroot.run(["mkdir", "-p", "/run/migd", "/var/lib/migd"])
        self.chroot.run(["chmod", "755", "/run/migd"])
        with_config: list[str] = []
        if self.config is not None:
            self.chroot.run(["mkdir", "-p", str(PurePosixPath(self.CONFIG).parent)])
            self.chroot.write_file(self.CONFIG, self.config)
            with_config = ["--config", self.CONFIG]
        settings = self.settings
        if settings is None:
            settings = [
                'api.lease_users=["*"]',
                f"reaper.interval_s={self.reaper_interval_s}",
                "policy.idle_policy=keep",
            ]
        argv = self.chroot.command(
            [
                "/usr/bin/migd",
                *with_config,
                "--simulate",
                self.simulate,
                "--state-dir",
                "/var/lib/migd",
                "--socket",
                SOCKET,
                "--log-format",
                "json",
                *(arg for setting in settings for arg in ("--set", setting)),
            ]
        )
        log = self.chroot.path("/var/log/migd-test.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=out)
        self.chroot.protected_pids.add(self.proc.pid)
        self.wait_for(lambda: self.ctl("status", "--json") is not None, "migd to answer")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        if self.proc is not None:
            self.chroot.protected_pids.discard(self.proc.pid)
        if self.config is not None:
            # The test's own file must not outlive it: /etc/migd is the package's
            # (tests/packaging checks that purge leaves no /etc/migd).
            self.chroot.run(["rm", "-f", self.CONFIG], check=False)

    def ctl(self, *args: str) -> Any:
        result = self.chroot.run(
            ["/usr/bin/migctl", "--socket", SOCKET, *args], check=False, timeout=60
        )
        if result.returncode != 0:
            return None
        return json.loads(result.stdout) if "--json" in args else result.stdout

    def leases(self, all_leases: bool = False) -> list[dict[str, Any]]:
        args = ["leases", "--json"] + (["--all"] if all_leases else [])
        return list(self.ctl(*args)["leases"])

    def history(self, job_id: str) -> list[dict[str, Any]]:
        return list(self.ctl("history", "--job", job_id, "--json")["history"])

    def job_leases(self, job_id: str) -> list[dict[str, Any]]:
        """Every lease of the job (ended ones too), oldest first."""
        return sorted(
            (x for x in self.leases(all_leases=True) if x["job_id"] == job_id),
            key=lambda x: float(x["created_s"]),
        )

    def log(self) -> str:
        return self.chroot.path("/var/log/migd-test.log").read_text()

    @staticmethod
    def wait_for(cond: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def installed(migd_installed: CondorChroot) -> CondorChroot:
    return migd_installed


@pytest.fixture
def migd(installed: CondorChroot) -> Iterator[Migd]:
    daemon = Migd(installed)
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        print(daemon.log()[-20000:])


def gpu_pool(personal_pool: Callable[..., PersonalPool], extra: str = "") -> PersonalPool:
    """A personal pool (access and execute point) on the packaged drop-ins plus the knobs."""
    return personal_pool(POOL_CONFIG + extra)


def active_leases(daemon: Migd, cluster: int) -> list[dict[str, Any]]:
    """The active leases of job ``cluster``.0. Active, not merely there: a job removed or
    a wrapper killed while its partition is still being made ends the lease "cancelled"
    (the wrapper went away waiting), which is right too but not what the tests ask."""
    return [
        x for x in daemon.leases() if f"#{cluster}.0#" in x["job_id"] and x["state"] == "active"
    ]


def migd_slots(pool: PersonalPool) -> list[dict[str, Any]]:
    """The slot ads once the startd cron has published a healthy migd ad in them."""
    slots: list[dict[str, Any]] = Migd.wait_for(
        lambda: [ad for ad in pool.startd_ads() if ad.get("MigdHealthy") is True],
        "the startd cron to publish migd's ad",
    )
    return slots


def simjob(memory_mib: int, *job_args: str, **submit: str) -> dict[str, str]:
    return {
        "executable": PY,
        "arguments": " ".join(["-m", "migd.backends.simulated.cuda_job", *job_args]),
        "request_GPUs": "1",
        "request_VRAM": str(memory_mib),
        "request_cpus": "1",
        "request_memory": "64",
        "transfer_executable": "false",  # the venv's python, not a copy in the sandbox
        **submit,
    }


def test_gpu_job_runs_on_a_right_sized_mig_instance(
    migd: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    pool = gpu_pool(personal_pool)
    slots = migd_slots(pool)
    assert slots[0]["MigdLargestPlaceableMB"] == A100_FULL_MIB
    assert max(ad.get("TotalGPUs", 0) for ad in slots) == 14  # 2 GPUs x 7 shares
    assert max(ad.get("TotalVRAM", 0) for ad in slots) == 2 * A100_FULL_MIB
    cluster = pool.submit(simjob(4000, "--print-env", "--start", "3G", "--steps", "2"))
    [ad] = pool.wait(cluster, timeout=120)
    out = pool.job_output(cluster)
    assert ad["ExitCode"] == 0, pool.job_error(cluster)
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert env["CUDA_VISIBLE_DEVICES"].startswith("MIG-")
    assert env["APPTAINERENV_CUDA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"]
    assert env["MIGD_GPU_MEMORY_LIMIT_MIB"] == "4864"  # 1g.5gb, the tightest fit
    assert "lease" in pool.job_error(cluster)
    # leases are named after the GlobalJobId (unique across access points)
    assert ad["GlobalJobId"].split("#")[1] == f"{cluster}.0"
    history = migd.history(ad["GlobalJobId"])
    assert {"submitted", "granted", "released"} <= {h["event"] for h in history}
    assert migd.leases() == []


def test_oom_on_a_small_instance_restarts_on_a_bigger_one(
    migd: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    pool = gpu_pool(personal_pool)
    # 3 GiB, then +1 GiB per step up to 7 GiB: dies on 1g.5gb (4864 MiB), fits 1g.10gb
    cluster = pool.submit(simjob(4000, "--start", "3G", "--grow", "1G", "--steps", "4"))
    [ad] = pool.wait(cluster, timeout=180)
    err = pool.job_error(cluster)
    assert ad["ExitCode"] == 0, err
    assert "CUDA out of memory" in err
    assert "restarting on a bigger partition" in err
    assert ad["RequestVRAM"] > 4864  # raised through chirp for any later run
    grants = [h for h in migd.history(ad["GlobalJobId"]) if h["event"] in ("granted", "submitted")]
    leases = migd.job_leases(ad["GlobalJobId"])
    # First the tightest fit, then the next memory size up: 1g.10gb, or 2g.10gb where
    # compute upsizing finds the second compute slice of that memory pair free.
    assert len(leases) >= 2 and leases[0]["profile"] == "1g.5gb", leases
    assert leases[-1]["profile"] in ("1g.10gb", "2g.10gb"), leases
    assert leases[-1]["memory_limit_mib"] > 4864 + 1000
    assert grants


def test_oom_at_the_largest_partition_is_held_with_a_reason(
    migd: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    pool = gpu_pool(personal_pool)
    # fits 7g.40gb at first, grows past it: nothing bigger exists on this node
    cluster = pool.submit(simjob(30000, "--start", "30G", "--grow", "6G", "--steps", "3"))
    ads = pool.wait(
        cluster, timeout=180, until=lambda ads: bool(ads) and ads[0].get("JobStatus") == 5
    )
    ad = ads[0]
    assert ad["JobStatus"] == 5, ad
    assert "ran out of GPU memory" in ad["HoldReason"]
    assert ad["HoldReasonSubCode"] == 86
    assert ad["RequestVRAM"] > A100_FULL_MIB
    # the reason names what the job ran out of, not the size it asked for next
    assert (
        f"with {A100_FULL_MIB} MiB and needs at least {ad['RequestVRAM']} MiB" in (ad["HoldReason"])
    )
    assert migd.leases() == []


def test_request_larger_than_any_partition_is_held_at_once(
    migd: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    # (the test pool checks periodic holds every 5 s: PERIODIC_EXPR_INTERVAL, condor_pool.py)
    pool = gpu_pool(personal_pool)
    cluster = pool.submit(simjob(100_000, "--start", "1G"))
    ads = pool.wait(
        cluster, timeout=60, until=lambda ads: bool(ads) and ads[0].get("JobStatus") == 5
    )
    assert "larger than the largest GPU partition" in ads[0]["HoldReason"]
    assert ads[0].get("NumJobStarts", 0) == 0


def test_condor_rm_releases_the_lease(
    migd: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    pool = gpu_pool(personal_pool)
    cluster = pool.submit(simjob(4000, "--start", "1G", "--steps", "600", "--step-s", "0.1"))
    # A loaded run once removed the job before its lease was active (see active_leases).
    migd.wait_for(lambda: active_leases(migd, cluster), "the job's lease to be active")
    pool.rm(cluster)
    migd.wait_for(lambda: migd.leases() == [], "the lease to be released", timeout_s=30)
    [lease] = [x for x in migd.leases(all_leases=True) if f"#{cluster}.0#" in x["job_id"]]
    assert lease["state"] == "released"


def test_daemon_down_sends_the_job_back_with_the_reason(
    migd: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    # Without the START guard (first line of defence) the wrapper's error file is the second.
    # The admin's knob MIGD_MAX_START_FAILURES (10 shipped) is lowered to keep the test short;
    # the hold must come from that knob, not from the shipped number.
    failures = 3
    pool = gpu_pool(personal_pool, f"MIGD_START = True\nMIGD_MAX_START_FAILURES = {failures}\n")
    migd.stop()
    cluster = pool.submit(simjob(4000, "--start", "1G"))
    ads = pool.wait(
        cluster, timeout=120, until=lambda ads: bool(ads) and ads[0].get("JobStatus") == 5
    )
    ad = ads[0]
    assert "migd is not available" in ad["HoldReason"], ad["HoldReason"]
    assert ad["HoldReasonSubCode"] == 87
    assert ad["NumJobStarts"] >= failures and ad.get("NumJobCompletions", 0) == 0
    # counted by the wrapper through chirp: only starts migd failed hold a job
    assert ad["MigdStartFailures"] >= failures


def test_oom_exit_requeues_the_job_and_it_reruns_bigger(
    migd: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    """Exit 86 through the real wrapper and the shipped access-point policy (no restart in
    the slot: MigdMaxRestarts = 0), then a re-match with the RequestVRAM it chirped; and a
    job that exits 86 by itself keeps its own exit policy."""
    pool = gpu_pool(personal_pool)
    # Each step held long enough to be sampled: 4 GiB seen, then 1 GiB more fails on the
    # 4864 MiB 1g.5gb, so the evidence (peak + failed allocation) decides the new request.
    grows = pool.submit(
        simjob(
            4000, "--start", "3G", "--grow", "1G", "--steps", "4", "--step-s", "1.5",
            **{"+MigdMaxRestarts": "0"},
        )
    )  # fmt: skip
    own = pool.submit(simjob(1000, "--start", "1G", "--exit", "86"))
    [ad] = pool.wait(grows, timeout=240)
    err = pool.job_error(grows)
    assert ad["ExitCode"] == 0, err
    assert ad["NumJobStarts"] == 2 and ad["MigdOomExits"] == 1, ad
    assert ad["MigdOomExit"] is False  # cleared by the second run
    wanted = 4 * 1024 + MIG_IDLE_USED_MIB + 1024
    assert ad["RequestVRAM"] == wanted and ad["MigdLastVRAM"] == 4864
    # (the error file holds the last run only) the first run's verdict is in migd's history
    [oom] = [h for h in migd.history(ad["GlobalJobId"]) if h["event"] == "wrapper.oom"]
    assert oom["data"]["wanted_mib"] == wanted and oom["data"]["oom"]["kind"] == "strong"
    first, second = migd.job_leases(ad["GlobalJobId"])
    assert first["profile"] == "1g.5gb"
    assert int(second["memory_limit_mib"]) >= 9984  # the next size up, on the rerun
    [own_ad] = pool.wait(own, timeout=120)
    assert own_ad["ExitCode"] == 86 and own_ad["JobStatus"] == 4  # done, as it asked
    assert own_ad["NumJobStarts"] == 1 and own_ad.get("MigdOomExit") is None
    assert migd.leases() == []


def test_early_restart_through_htcondor(
    migd: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    pool = gpu_pool(personal_pool)
    grows = ["--start", "1G", "--grow", "50M", "--steps", "150", "--step-s", "0.03"]
    submit = {
        "+MigdEarlyRestart": "true",
        "+MigdHorizon": "150",
        # the wrapper runs with the job's environment: a per-job setting
        "environment": '"MIGD_WRAPPER_SAMPLE_INTERVAL_S=0.2"',
    }
    cluster = pool.submit(simjob(3000, *grows, **submit))
    [ad] = pool.wait(cluster, timeout=180)
    err = pool.job_error(cluster)
    assert ad["ExitCode"] == 0, err
    assert "forecast: will not fit" in err and "CUDA out of memory" not in err
    history = migd.history(ad["GlobalJobId"])
    [fired] = [h for h in history if h["event"] == "wrapper.forecast"]
    assert fired["data"]["forecast"]["series"] == "allocated"
    first, second = migd.job_leases(ad["GlobalJobId"])
    assert first["profile"] == "1g.5gb" and int(second["memory_limit_mib"]) > 4864


def test_job_exit_hook_releases_the_lease_of_a_sigkilled_wrapper(
    installed: CondorChroot, personal_pool: Callable[..., PersonalPool]
) -> None:
    """The wrapper cannot release what it holds when it is SIGKILLed; the reaper is off
    here, so only the JOB_EXIT hook can have released the lease."""
    daemon = Migd(installed)
    daemon.reaper_interval_s = 3600.0
    daemon.start()
    try:
        pool = gpu_pool(personal_pool)
        cluster = pool.submit(simjob(4000, "--start", "1G", "--steps", "600", "--step-s", "0.1"))
        # (a loaded run killed a wrapper whose partition was still being made: see
        # active_leases)
        [lease] = daemon.wait_for(
            lambda: active_leases(daemon, cluster), "the job's lease to be active"
        )
        wrapper_pid = int(lease["owner_pid"])
        cmdline = Path(f"/proc/{wrapper_pid}/cmdline").read_bytes()
        assert b"migd-wrapper" in cmdline, cmdline
        os.kill(wrapper_pid, signal.SIGKILL)
        pool.wait(cluster, timeout=120)
        daemon.wait_for(lambda: daemon.leases() == [], "the hook to release it", timeout_s=30)
        [ended] = [x for x in daemon.leases(all_leases=True) if x["lease_id"] == lease["lease_id"]]
        assert ended["state"] == "released"  # not "reclaimed": the reaper did not run
        released = [h for h in daemon.history(lease["job_id"]) if h["event"] == "released"]
        assert "JOB_EXIT hook" in released[0]["data"]["reason"]
    finally:
        daemon.stop()
        print(daemon.log()[-20000:])


# Long on its first run (migd takes its lease back under it), short once the wrapper has
# chirped the loss into its ad (the rerun), so the test stays fast.
TAKEN_BACK_JOB = f"""#!/bin/sh
if grep -q '^MigdLeaseLosses' "$_CONDOR_JOB_AD"; then steps=1; else steps=6000; fi
exec {PY} -m migd.backends.simulated.cuda_job --start 1G --steps $steps --step-s 0.1
"""


def test_a_lease_migd_takes_back_requeues_the_job_with_the_reason(
    migd: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    pool = gpu_pool(personal_pool)
    cluster = pool.submit(
        {**simjob(4000), "executable": "job.sh", "arguments": "", "transfer_executable": "true"},
        files={"job.sh": TAKEN_BACK_JOB},
    )
    [lease] = migd.wait_for(lambda: active_leases(migd, cluster), "the job's lease")
    assert migd.ctl("release", lease["lease_id"], "--reason", "GPU needed") is not None
    [ad] = pool.wait(cluster, timeout=180)
    # Stopped, back to the queue (not held, not completed with migd's exit), run again.
    assert ad["JobStatus"] == 4 and ad.get("ExitCode") == 0, ad
    assert ad["NumJobStarts"] == 2, ad
    assert ad["MigdLeaseLosses"] == 1 and ad["MigdLeaseEndReason"] == "admin_release", ad
    assert str(ad["MigdLeaseLostReason"]).startswith(
        "an administrator released the job's GPU partition (GPU needed)"
    ), ad
    assert ad.get("MigdLeaseLost") is False, ad  # the rerun cleared the marker
    log = pool.user_log(cluster)
    assert "migd: an administrator released the job's GPU partition (GPU needed)" in log, log
    assert "Job was evicted" in log, log
    [first, _] = migd.job_leases(lease["job_id"])
    assert first["end_reason"] == "admin_release"


def test_request_gpus_two_gets_a_partition_on_each_assigned_gpu(
    migd: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    """``request_GPUs = 2`` (issue 22, pool scenario n6): two partitions, one behind each
    share HTCondor assigned, both in the job's CUDA_VISIBLE_DEVICES; condor_history
    records the assigned shares (job_machine_attrs) and a clean exit."""
    pool = gpu_pool(personal_pool)
    migd_slots(pool)
    job = simjob(
        4000,
        *("--print-env", "--start", "1G", "--steps", "1"),
        request_GPUs="2",
        job_machine_attrs="AssignedGPUs",
    )
    cluster = pool.submit(job)
    [ad] = pool.wait(cluster, timeout=180)
    err = pool.job_error(cluster)
    assert ad["ExitCode"] == 0, err
    assigned = [s.strip() for s in str(ad["MachineAttrAssignedGPUs0"]).split(",")]
    assert len(assigned) == 2, ad
    print(f"request_GPUs = 2: HTCondor assigned {assigned}")  # one GPU or two: both served
    env = dict(line.split("=", 1) for line in pool.job_output(cluster).splitlines() if "=" in line)
    devices = env["CUDA_VISIBLE_DEVICES"].split(",")
    assert len(devices) == 2 and len(set(devices)) == 2, env
    assert all(d.startswith("MIG-") for d in devices), env
    assert env["APPTAINERENV_CUDA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"]
    assert len(env["MIGD_LEASE_IDS"].split(",")) == 2
    leases = migd.job_leases(ad["GlobalJobId"])
    assert len(leases) == 2, leases
    by_device = {x["mig_uuid"]: x for x in leases}
    assert set(by_device) == set(devices), leases
    # member i on the GPU behind the i-th assigned share, in CUDA_VISIBLE_DEVICES order
    for share, device in zip(assigned, devices, strict=True):
        assert by_device[device]["gpu_uuid"].startswith(physical_gpu(share)), (share, leases)
    assert all(x["profile"] == "1g.5gb" for x in leases)  # 4000 MiB per GPU, not in total
    assert migd.leases() == []
