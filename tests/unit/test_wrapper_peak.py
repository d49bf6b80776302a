"""The peak the wrapper tells the job (MigdPeakMB) and migd (its history) is never below
what the job used (issue 21 §5): the largest of every source, each tested alone with a
stand-in daemon: the wrapper's own samples, migd's samples (the release reply), the
OOM message's figures (what the job held, plus the allocation that failed), the
partition a strong OOM without figures filled."""

from __future__ import annotations

import dataclasses
import io
import sys
from collections.abc import Mapping
from typing import Any

from migd.wrapper.jobspec import spec_from_flags
from migd.wrapper.runner import OOM_EXIT_CODE, JobRunner
from migd.wrapper.settings import WrapperSettings
from migd.wrapper_options import WrapperOptions

LIMIT = 4864
TORCH_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a "
    "total capacity of 4.75 GiB of which 1792.00 MiB is free. Of the allocated memory "
    "3072.00 MiB is allocated by PyTorch."
)


class Daemon:
    """Grants one MIG lease; answers usage with ``sampled`` and the release with ``at_release``."""

    def __init__(self, sampled: int | None = None, at_release: int | None = None) -> None:
        self.sampled, self.at_release = sampled, at_release
        self.reports: list[tuple[str, dict[str, Any]]] = []
        self.calls: list[str] = []

    def lease(self, **request: Any) -> dict[str, Any]:
        return {
            "lease_id": "L1",
            "gpu": 0,
            "gpu_uuid": "GPU-0",
            "mode": "mig",
            "profile": "1g.5gb",
            "memory_limit_mib": LIMIT,
            "env": {},
        }

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        self.calls.append(op)
        if op == "get_lease":
            return {"state": "active", "end_reason": None}
        if op == "usage":
            return {"peak_used_mib": self.sampled, "device_used_mib": self.sampled}
        if op == "report":
            self.reports.append((args["event"], dict(args["data"])))
        return {}

    def status(self) -> dict[str, Any]:
        return {"gpus": []}

    def release(self, lease_id: str, reason: str) -> dict[str, Any]:
        self.calls.append("release")
        return {"state": "released", "end_reason": "released", "peak_used_mib": self.at_release}


def run(daemon: Daemon, script: str) -> tuple[int, list[Mapping[str, Any]]]:
    chirps: list[Mapping[str, Any]] = []

    def chirp(attrs: Mapping[str, Any]) -> str:
        chirps.append(dict(attrs))
        return "chirp"

    spec = spec_from_flags(
        [sys.executable, "-c", script], gpu_memory="3G", job_id="5.0", max_restarts=0
    )
    spec = dataclasses.replace(spec, under_condor=True, want_chirp=True)
    settings = WrapperSettings(WrapperOptions(sample_interval_s=0.05))
    runner = JobRunner(
        spec,
        daemon,  # type: ignore[arg-type]
        settings=settings,
        set_job_attrs=chirp,
        err=io.BytesIO(),
    )
    return runner.run(), chirps


def peak_mb(chirps: list[Mapping[str, Any]]) -> int | None:
    values = [c["MigdPeakMB"] for c in chirps if "MigdPeakMB" in c]
    assert all(c.get("GPUsMemoryUsage") == c["MigdPeakMB"] for c in chirps if "MigdPeakMB" in c)
    return values[-1] if values else None


def oom_job(message: str, *, seconds: float = 0.0) -> str:
    write = f"sys.stderr.write({message!r} + '\\n')"
    return f"import sys, time; time.sleep({seconds}); {write}; sys.exit(1)"


def test_the_oom_messages_figures_when_nothing_was_sampled() -> None:
    """The attempt that ran out at 4096 MiB recorded "peak unknown" before."""
    daemon = Daemon()
    code, chirps = run(daemon, oom_job(TORCH_OOM))
    assert code == OOM_EXIT_CODE
    assert peak_mb(chirps) == 3072 + 1024  # held plus the allocation that failed
    # migd heard what the job held before the release (its history's peak is usage) ...
    [(_, data)] = [r for r in daemon.reports if r[0] == "exit"]
    assert data["peak_used_mib"] == 3072 and data["exit_code"] == 1
    assert daemon.calls.index("report") < daemon.calls.index("release")
    # ... and the OOM report says what it asked for, not "peak unknown".
    [(_, oom)] = [r for r in daemon.reports if r[0] == "oom"]
    assert oom["peak_used_mib"] == 4096
    assert "peak unknown" not in oom["oom"]["reason"]


def test_migds_samples_at_the_release_when_higher() -> None:
    daemon = Daemon(sampled=None, at_release=4500)
    code, chirps = run(daemon, oom_job(TORCH_OOM))
    assert code == OOM_EXIT_CODE
    # used 4500 (migd saw it), asked 4500 + 1024 (restart sizing adds what failed)
    assert peak_mb(chirps) == 4500 + 1024


def test_the_wrappers_own_samples_when_migd_has_none() -> None:
    daemon = Daemon(sampled=2500, at_release=None)
    code, chirps = run(daemon, "import time; time.sleep(0.5)")
    assert code == 0
    assert peak_mb(chirps) == 2500
    [(_, data)] = [r for r in daemon.reports if r[0] == "exit"]
    assert data["peak_used_mib"] == 2500


def test_a_strong_oom_without_figures_filled_its_partition() -> None:
    daemon = Daemon()
    code, chirps = run(daemon, oom_job("RuntimeError: CUDA error: out of memory"))
    assert code == OOM_EXIT_CODE
    assert peak_mb(chirps) == LIMIT  # it needed more than the partition it had


def test_the_largest_source_wins() -> None:
    # samples 3500 > held 3072: used 3500, asked 3500 + 1024
    daemon = Daemon(sampled=3500, at_release=3400)
    code, chirps = run(daemon, oom_job(TORCH_OOM, seconds=0.3))
    assert code == OOM_EXIT_CODE
    assert peak_mb(chirps) == 3500 + 1024


def test_nothing_known_chirps_nothing() -> None:
    daemon = Daemon()
    code, chirps = run(daemon, "pass")
    assert code == 0 and peak_mb(chirps) is None
