"""Simulated jobs and the runtime model the simulator charges them (pure).

A :class:`WorkloadJob` is what a user submits: when, how much GPU memory it asks for,
and how long it runs alone on a whole GPU. How long it runs on *less* than a
whole GPU is the model's central assumption, stated once here:

**Compute demand.** ``compute_demand`` ``d`` (0 < d <= 1) is the fraction of a whole
GPU's compute the job can keep busy. Given a share ``f`` of the GPU (a MIG
instance with ``c`` of ``C`` compute slices has ``f = c / C``; an exclusive GPU
``f = 1``; an MPS client ``f = d / max(1, sum of the clients' d)``), the job runs
``runtime_s * max(1, d / f)``: no slower while its share covers its demand,
proportionally slower below it (processor sharing). [MIG-HT] Table 3 measured a
Rodinia job at 1.17 s on ``1g.5gb`` versus 0.52 s on the whole A100, i.e.
``d * 7 = 2.24`` and ``d = 0.32``; the workload generators cite where each ``d``
comes from.

**Moldable jobs** ([Villarrubia]) instead carry ``slice_times``: measured or generated
seconds on an instance of each size. Between sizes the time is interpolated
linearly in the slice count, below the smallest size it grows as ``1 / s``.

**Memory growth.** A job with :class:`Growth` allocates more memory every
iteration (LLM context growth, [MIG-HT] §2.3): iteration ``i`` of ``n`` holds
``start + (peak - start) * i / (n - 1)`` MiB plus seeded Gaussian noise. It
runs out of memory in the first iteration whose memory exceeds its limit
(partition size, MPS pinned limit, or the whole GPU).

**Power** (:class:`PowerModel`): ``idle_w`` per GPU plus ``slice_w`` per busy
compute slice, where a job keeps ``C * min(f, d)`` slices busy.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from migd.errors import InvalidRequest


@dataclass(frozen=True)
class Growth:
    """Per-iteration memory growth of a job ([MIG-HT]'s dynamic LLM workloads).

    Attributes:
        start_mib: memory held in the first iteration.
        peak_mib: memory held in the last iteration (before noise).
        iterations: number of iterations; the job's runtime is spread evenly over them.
        noise_mib: standard deviation of the per-iteration Gaussian noise.
        seed: seed of that noise (the series is a pure function of the fields).
    """

    start_mib: int
    peak_mib: int
    iterations: int
    noise_mib: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.iterations < 2:
            raise InvalidRequest(
                f"a growing job needs at least 2 iterations, got {self.iterations}",
                hint="give growth iterations >= 2, or drop the growth columns",
            )
        if self.start_mib <= 0 or self.peak_mib < self.start_mib:
            raise InvalidRequest(
                f"growth must go from a positive start up to a peak "
                f"(start {self.start_mib} MiB, peak {self.peak_mib} MiB)",
                hint="peak_mib must be at least memory_mib",
            )

    @cached_property
    def series(self) -> tuple[float, ...]:
        """Memory (MiB) held in each iteration, noise included, never below 1 MiB."""
        rng = random.Random(self.seed)
        span = self.peak_mib - self.start_mib
        last = self.iterations - 1
        out = []
        for i in range(self.iterations):
            noise = rng.gauss(0.0, self.noise_mib) if self.noise_mib > 0 else 0.0
            out.append(max(1.0, self.start_mib + span * i / last + noise))
        return tuple(out)

    def first_over(self, limit_mib: float) -> int | None:
        """The first iteration whose memory exceeds ``limit_mib`` (the OOM), or ``None``."""
        for i, mib in enumerate(self.series):
            if mib > limit_mib:
                return i
        return None


@dataclass(frozen=True)
class WorkloadJob:
    """One submitted job.

    Attributes:
        job_id: unique name.
        submit_s: submission time (simulated seconds).
        memory_mib: GPU memory the job asks for (HTCondor ``request_VRAM``).
        runtime_s: seconds alone on a whole GPU (ignored when ``slice_times`` is set).
        compute_demand: fraction of a whole GPU it keeps busy (module docstring).
        min_compute: compute slices it asks for at least (0: any).
        slice_times: seconds on an instance of each compute size (moldable jobs).
        growth: per-iteration memory growth (may run out of memory).
        uid: owner (one MPS server serves one UID unless multi-user).
        wait_s: how long it may wait for a partition; ``None`` forever, 0 not at all
            (refused at once when nothing fits: [Siavashi]'s acceptance semantics).
        kind: a label for reports (``small``, ``qwen2``, ...).
        horizon: the horizon the job declares for the memory forecast (HTCondor
            ``MigdHorizon``: its total iterations), as the wrapper passes it; ``None``
            (the default, as for a job that sets nothing) lets the forecaster look
            only as far ahead as it has observed.
    """

    job_id: str
    submit_s: float
    memory_mib: int
    runtime_s: float = 0.0
    compute_demand: float = 1.0
    min_compute: int = 0
    slice_times: Mapping[int, float] | None = field(default=None, hash=False)
    growth: Growth | None = None
    uid: int = 1000
    wait_s: float | None = None
    kind: str = ""
    horizon: float | None = None

    def __post_init__(self) -> None:
        if self.memory_mib <= 0:
            raise InvalidRequest(f"{self.job_id}: memory_mib must be positive")
        if self.submit_s < 0 or not math.isfinite(self.submit_s):
            raise InvalidRequest(f"{self.job_id}: submit_s must be a finite time >= 0")
        if self.slice_times is None and not (self.runtime_s > 0 and math.isfinite(self.runtime_s)):
            raise InvalidRequest(
                f"{self.job_id}: runtime_s must be positive",
                hint="give the job's runtime alone on a whole GPU in seconds",
            )
        if self.slice_times is not None and (
            not self.slice_times or any(t <= 0 or s <= 0 for s, t in self.slice_times.items())
        ):
            raise InvalidRequest(f"{self.job_id}: slice_times need positive sizes and times")
        if not 0.0 < self.compute_demand <= 1.0:
            raise InvalidRequest(
                f"{self.job_id}: compute_demand must be in (0, 1], got {self.compute_demand}",
                hint="the fraction of a whole GPU the job keeps busy, e.g. 0.3",
            )
        if self.wait_s is not None and self.wait_s < 0:
            raise InvalidRequest(f"{self.job_id}: wait_s must not be negative")
        if self.horizon is not None and not (self.horizon > 0 and math.isfinite(self.horizon)):
            raise InvalidRequest(
                f"{self.job_id}: horizon must be a positive number of iterations",
                hint="leave it empty when the job declares no MigdHorizon",
            )


def demand_of(job: WorkloadJob, compute_slices: int) -> float:
    """The job's compute demand as a GPU fraction.

    For moldable jobs: the smallest size whose time is within 5 % of its best time,
    over the GPU's compute slices.
    """
    if job.slice_times is None:
        return job.compute_demand
    best = min(job.slice_times.values())
    size = min(s for s, t in job.slice_times.items() if t <= 1.05 * best)
    return min(1.0, size / compute_slices)


def runtime_at(job: WorkloadJob, share: float, compute_slices: int) -> float:
    """Seconds the job takes with ``share`` (0 < share <= 1) of a GPU of ``compute_slices``."""
    if share <= 0:
        raise ValueError("share must be positive")
    if job.slice_times is None:
        return job.runtime_s * max(1.0, job.compute_demand / share)
    times = job.slice_times
    sizes = sorted(times)
    s = share * compute_slices
    if s >= sizes[-1]:
        return times[sizes[-1]]
    if s <= sizes[0]:
        return times[sizes[0]] * sizes[0] / s
    for lo, hi in itertools.pairwise(sizes):
        if lo <= s <= hi:
            w = (s - lo) / (hi - lo)
            return times[lo] * (1 - w) + times[hi] * w
    raise AssertionError("unreachable")  # pragma: no cover


def busy_fraction(job: WorkloadJob, share: float, compute_slices: int) -> float:
    """Fraction of the GPU the job keeps busy with ``share`` of it: ``min(share, d)``."""
    return min(share, demand_of(job, compute_slices))


@dataclass(frozen=True)
class PowerModel:
    """GPU power: ``idle_w`` per GPU plus ``slice_w`` per busy compute slice.

    The default is an A100 PCIe 40GB: 250 W TDP (NVIDIA A100 PCIe product brief);
    40 W idle is an assumption (a typical ``nvidia-smi`` reading of an idle A100
    PCIe in persistence mode), the remaining 210 W spread linearly over 7 slices.
    Power that does not scale with busy slices (a lone small kernel keeping clocks
    and HBM up) is not modelled: that makes packing look *less* energy-efficient
    than [MIG-HT] measured, never more.
    """

    idle_w: float = 40.0
    slice_w: float = 30.0

    @classmethod
    def for_model(cls, model: str, compute_slices: int) -> PowerModel:
        """TDP-based defaults per family (board power, PCIe/SXM as the catalog model implies)."""
        tdp_w = {
            "A30": 165.0,
            "A100-40GB": 250.0,
            "A100-80GB": 300.0,
            "H100-80GB": 700.0,
            "H100-94GB": 400.0,
            "H100-96GB": 700.0,
            "H200": 700.0,
            "GH200": 900.0,
            "B200": 1000.0,
            "GB200": 1200.0,
            "RTX-PRO": 600.0,
        }
        tdp = next((w for key, w in tdp_w.items() if model.startswith(key)), 250.0)
        idle = round(0.16 * tdp, 1)
        return cls(idle_w=idle, slice_w=round((tdp - idle) / compute_slices, 2))

    def watts(self, busy_slices: float) -> float:
        return self.idle_w + self.slice_w * busy_slices
