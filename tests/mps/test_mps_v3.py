"""The MPS v3 path (per-cgroup device-memory limits), behind detection, on the stand-in NVML.

The stand-in (migd.backends.simulated.dmem) follows NVIDIA's documentation, cited there;
nothing here ran on hardware (the lent machines run driver 580).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from migd.backends.mps.dmem import NvmlCgroupLimits, has_symbol
from migd.backends.simulated.dmem import SimDmemNvml
from migd.core.mps import mps_v3_unsupported
from migd.errors import GpuError, GpuPermissionDenied, GpuUnsupported


@pytest.mark.parametrize(
    ("driver", "symbol", "mig", "v2", "why"),
    [
        ("580.159.04", True, False, True, "older than r615"),  # the lent H200's driver
        ("615.10.01", False, False, True, "no nvmlDeviceSetMemoryLimits_v1"),
        ("615.10.01", True, True, True, "non-MIG device"),
        ("615.10.01", True, False, False, "cgroup v2"),
        ("garbage", True, False, True, "cannot be read"),
        ("615.10.01", True, False, True, None),
        ("620.1", True, False, True, None),
    ],
)
def test_detection_names_the_first_missing_requirement(
    driver: str, symbol: bool, mig: bool, v2: bool, why: str | None
) -> None:
    got = mps_v3_unsupported(driver, has_symbol=symbol, mig_enabled=mig, cgroup_v2=v2)
    assert got is None if why is None else (got is not None and why in got)


@pytest.fixture
def cgroups(tmp_path: Path) -> Path:
    """A cgroup v2 hierarchy with one job's cgroup, as HTCondor makes one per job."""
    (tmp_path / "cgroup.controllers").write_text("cpu memory dmem\n")
    job = tmp_path / "htcondor" / "condor_var_lib_condor_execute_slot1_1@node"
    job.mkdir(parents=True)
    (job / "cgroup.procs").write_text("")
    return tmp_path


def job_cgroup(cgroups: Path) -> str:
    return str(cgroups / "htcondor" / "condor_var_lib_condor_execute_slot1_1@node")


def test_a_job_cgroup_gets_a_hard_limit_that_holds_every_process_of_the_job(
    cgroups: Path,
) -> None:
    nvml = SimDmemNvml()
    limits = NvmlCgroupLimits(nvml, cgroup_root=cgroups)
    job = job_cgroup(cgroups)
    assert limits.support(0) is None
    limits.set_limit(0, job, hard_mib=4096)
    got = limits.get_limit(0, job)
    assert (got.soft_mib, got.hard_mib, got.used_mib) == (0, 4096, 0)
    # Per cgroup, not per process: two processes of the job share the 4096 MiB.
    assert nvml.alloc(0, job, 3000) and not nvml.alloc(0, job, 1200)
    assert limits.get_limit(0, job).used_mib == 3000
    limits.clear_limit(0, job)
    assert limits.get_limit(0, job).hard_mib is None


def test_removing_the_cgroup_clears_its_limits(cgroups: Path) -> None:
    nvml = SimDmemNvml()
    limits = NvmlCgroupLimits(nvml, cgroup_root=cgroups)
    job = job_cgroup(cgroups)
    limits.set_limit(0, job, hard_mib=1024)
    (Path(job) / "cgroup.procs").unlink()
    Path(job).rmdir()
    assert nvml.alloc(0, job, 8192) and nvml.limits == {}


def test_what_nvidia_documents_it_refuses(cgroups: Path) -> None:
    job = job_cgroup(cgroups)
    with pytest.raises(GpuPermissionDenied):
        NvmlCgroupLimits(SimDmemNvml(is_root=False), cgroup_root=cgroups).set_limit(0, job, 1024)
    mig = NvmlCgroupLimits(SimDmemNvml(mig_enabled=frozenset({0})), cgroup_root=cgroups)
    assert "non-MIG" in (mig.support(0) or "")
    with pytest.raises(GpuError):
        mig.set_limit(0, job, 1024)
    with pytest.raises(GpuError):  # not a cgroup directory
        NvmlCgroupLimits(SimDmemNvml(), cgroup_root=cgroups).set_limit(0, str(cgroups / "x"), 1)


def test_driver_580_is_detected_as_unsupported_and_never_called(cgroups: Path) -> None:
    nvml = SimDmemNvml(driver_version="580.159.04")
    limits = NvmlCgroupLimits(nvml, cgroup_root=cgroups)
    assert not has_symbol(nvml)
    assert "older than r615" in (limits.support(0) or "")
    with pytest.raises(GpuUnsupported):
        limits.set_limit(0, job_cgroup(cgroups), 1024)


def test_a_host_without_cgroup_v2_is_unsupported(cgroups: Path) -> None:
    (cgroups / "cgroup.controllers").unlink()
    limits = NvmlCgroupLimits(SimDmemNvml(), cgroup_root=cgroups)
    assert "cgroup v2" in (limits.support(0) or "")


def test_limits_are_checked_before_nvml_is_asked(cgroups: Path) -> None:
    limits = NvmlCgroupLimits(SimDmemNvml(), cgroup_root=cgroups)
    with pytest.raises(ValueError, match="soft <= hard"):
        limits.set_limit(0, job_cgroup(cgroups), hard_mib=1024, soft_mib=2048)
