"""Numbers from a simulation run: throughput, waits, utilisation, waste, energy.

Definitions (the report repeats them):

* **makespan**: first submission to last completion.
* **throughput**: completed jobs per hour of makespan. A run that did not complete
  every job (refused, failed or unfinished ones) is *incomplete* (:attr:`Metrics.complete`);
  its throughput counts only what ran, so reports mark it (†) rather than rank it.
* **turnaround**: completion minus submission (completed jobs; p50/p95).
* **acceptance**: jobs that ever ran / jobs submitted; **time to first
  placement**: first start minus submission (includes MIG creation time).
* **compute utilisation**: time-weighted busy compute slices / all slices over the
  makespan; a job keeps ``C * min(share, demand)`` slices busy (:mod:`migd.policysim.jobs`).
* **allocated slices**: compute slices of the partitions jobs hold (a whole GPU
  for exclusive, the demand-weighted share for MPS) / all slices.
* **wasted slices**: time-weighted compute + memory slices of the committed MIG
  layout that no completion of it can ever use ([Turkkan]), per GPU.
* **reconfiguration**: create/destroy operations and their [Villarrubia] Table 1 seconds.
* **OOM loss**: GPU-seconds (GPU share x wall time) of runs killed by an OOM or
  restarted early by the forecast.
* **steady throughput**: completed jobs per hour between the first completion (before
  it the node is filling up) and the moment the last job starts (after it the node
  runs out of work), as [Voigtlaender] Table 2 cuts its benchmark to "the part during
  which the benchmark machine is fully utilized".
* **slice-weighted acceptance**: the slice-hours (compute slices x runtime alone on
  the whole GPU) of jobs that ran / of all jobs: a policy that refuses the big jobs
  and accepts the small ones scores low here even when it accepts many requests.
* **isolation breaches**: runs that shared an MPS server with another user's job
  (memory is then protected only by the pinned limit, not by MIG or a per-user
  server); must be 0.
* **energy**: the integral of ``idle_w + slice_w * busy slices`` per GPU over the
  makespan; per completed job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from migd.core.geometry import Geometry
from migd.policysim.engine import PolicySimResult
from migd.policysim.jobs import WorkloadJob, runtime_at


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Metrics:
    """Summary of one run (see the module docstring for definitions)."""

    policy: str
    jobs: int
    completed: int
    rejected: int
    failed: int
    unfinished: int
    makespan_s: float
    throughput_per_h: float
    turnaround_p50_s: float
    turnaround_p95_s: float
    acceptance: float
    first_placement_mean_s: float
    first_placement_p95_s: float
    compute_util: float
    allocated_util: float
    wasted_slices: float
    creates: int
    destroys: int
    reconfig_s: float
    oom_kills: int
    forecast_kills: int
    oom_lost_gpu_s: float
    energy_kj: float
    energy_per_job_kj: float
    events: int
    steady_throughput_per_h: float = math.nan
    slice_acceptance: float = math.nan
    isolation_breaches: int = 0

    @property
    def complete(self) -> bool:
        """Every job completed. Throughput only counts completed jobs over *their*
        makespan, so a run that refused or lost jobs can look faster than one that ran
        them all; tables mark such runs with a dagger."""
        return self.completed == self.jobs

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "complete": self.complete}


def _integrate(
    line: Sequence[tuple[float, float, float, float, float]], column: int, end_s: float
) -> float:
    total = 0.0
    for (t0, *vals), nxt in zip(line, [*line[1:], None], strict=True):
        t1 = end_s if nxt is None else min(nxt[0], end_s)
        if t1 > t0:
            total += vals[column - 1] * (t1 - t0)
        if nxt is not None and nxt[0] >= end_s:
            break
    return total


def compute_metrics(result: PolicySimResult) -> Metrics:
    """Summarise a run."""
    records = result.records
    done = [r for r in records if r.outcome == "completed"]
    start = min((r.job.submit_s for r in records), default=0.0)
    end = max((r.end_s for r in done if r.end_s is not None), default=start)
    makespan = max(0.0, end - start)
    turnarounds = [r.turnaround_s for r in done if r.turnaround_s is not None]
    waits = [r.first_start_s - r.job.submit_s for r in records if r.first_start_s is not None]
    compute = result.geometry.compute_slices
    n_gpus = len(result.timelines)
    capacity = compute * n_gpus * makespan
    busy = sum(_integrate(line, 1, end) for line in result.timelines.values())
    alloc = sum(_integrate(line, 2, end) for line in result.timelines.values())
    wasted = sum(_integrate(line, 4, end) for line in result.timelines.values())
    energy_j = result.power.idle_w * n_gpus * makespan + result.power.slice_w * busy
    ran = sum(1 for r in records if r.first_start_s is not None)
    starts = [r.first_start_s for r in records if r.first_start_s is not None]
    ends = sorted(r.end_s for r in done if r.end_s is not None)
    cut = max(starts, default=start)
    steady = math.nan
    if ends and cut > ends[0]:
        # ends strictly after the first one, up to the cut: a rate over a full window
        inside = sum(1 for e in ends if ends[0] < e <= cut)
        steady = inside / (cut - ends[0]) * 3600.0 if inside else math.nan
    area = [_slice_hours(r.job.runtime_s, r.job.slice_times, compute) for r in records]
    area_all = sum(area)
    area_ran = sum(a for a, r in zip(area, records, strict=True) if r.first_start_s is not None)
    return Metrics(
        policy=result.policy.name,
        jobs=len(records),
        completed=len(done),
        rejected=sum(1 for r in records if r.outcome == "rejected"),
        failed=sum(1 for r in records if r.outcome == "failed"),
        unfinished=sum(1 for r in records if r.outcome == "unfinished"),
        makespan_s=makespan,
        throughput_per_h=len(done) / makespan * 3600.0 if makespan > 0 else 0.0,
        turnaround_p50_s=percentile(turnarounds, 50),
        turnaround_p95_s=percentile(turnarounds, 95),
        acceptance=ran / len(records) if records else math.nan,
        first_placement_mean_s=sum(waits) / len(waits) if waits else math.nan,
        first_placement_p95_s=percentile(waits, 95),
        compute_util=busy / capacity if capacity > 0 else 0.0,
        allocated_util=alloc / capacity if capacity > 0 else 0.0,
        wasted_slices=wasted / (n_gpus * makespan) if makespan > 0 else 0.0,
        creates=result.reconfig.creates,
        destroys=result.reconfig.destroys,
        reconfig_s=result.reconfig.create_s + result.reconfig.destroy_s,
        oom_kills=sum(r.oom_kills for r in records),
        forecast_kills=sum(r.forecast_kills for r in records),
        oom_lost_gpu_s=sum(r.lost_gpu_s for r in records),
        energy_kj=energy_j / 1000.0,
        energy_per_job_kj=energy_j / 1000.0 / len(done) if done else math.nan,
        events=result.events,
        steady_throughput_per_h=steady,
        slice_acceptance=area_ran / area_all if area_all > 0 else math.nan,
        isolation_breaches=result.isolation_breaches,
    )


def _slice_hours(runtime_s: float, slice_times: Mapping[int, float] | None, compute: int) -> float:
    """A job's weight for slice-weighted acceptance: whole-GPU slices x runtime alone
    (moldable jobs: their least slice-seconds)."""
    if slice_times:
        return float(min(s * t for s, t in slice_times.items())) / 3600.0
    return compute * runtime_s / 3600.0


def area_bounds(
    jobs: Sequence[WorkloadJob], geo: Geometry, gpus: int, reserve_mib: int
) -> AreaBounds:
    """Throughput no schedule can beat (jobs per hour), from the slice area jobs need.

    * ``mig``: every job on the MIG profile (of the ``classic`` set) that holds its memory
      with the least compute-slice-seconds (``slices x runtime there``), all of them
      packed with no gap into ``C`` compute slices per GPU; and likewise (minimised on
      its own) for memory slices. The larger of the two times bounds MIG-only policies.
    * ``shared``: whatever a job runs on, it keeps at least ``d x runtime alone`` of a
      GPU busy (a moldable job: its least ``size/C x time``) and pins its MiB for at
      least its shortest runtime, of the GPU's memory less the MPS reserve. A bound for
      every policy, MPS and the hybrid included.

    No job takes less than its shortest runtime. Arrival times and order are ignored
    (bounds for batches).
    """
    profiles = sorted(geo.profile_set("classic"), key=lambda p: p.memory_mib)
    c_total, m_total = geo.compute_slices, geo.units
    mig_c = mig_m = share_c = share_m = 0.0
    longest = 0.0
    mps_mib = max(1, geo.memory_mib - reserve_mib)
    for job in jobs:
        areas = [
            (p.compute_slices * t, p.memory_slices * t)
            for p in profiles
            if p.memory_mib >= job.memory_mib and p.compute_slices >= job.min_compute
            for t in (runtime_at(job, p.compute_slices / c_total, c_total),)
        ]
        if areas:
            mig_c += min(a[0] for a in areas)
            mig_m += min(a[1] for a in areas)
        if job.slice_times:
            fastest = min(job.slice_times.values())
            share_c += min(s / c_total * t for s, t in job.slice_times.items())
        else:
            fastest = job.runtime_s
            share_c += job.compute_demand * job.runtime_s
        longest = max(longest, fastest)
        share_m += job.memory_mib * fastest
    n = len(jobs)
    mig_t = max(mig_c / (c_total * gpus), mig_m / (m_total * gpus), longest)
    share_t = max(share_c / gpus, share_m / (mps_mib * gpus), longest)
    return AreaBounds(
        mig_per_h=n / mig_t * 3600.0 if mig_t > 0 else math.nan,
        shared_per_h=n / share_t * 3600.0 if share_t > 0 else math.nan,
    )


@dataclass(frozen=True)
class AreaBounds:
    """Throughput bounds of a batch (jobs per hour); :func:`area_bounds`."""

    mig_per_h: float
    shared_per_h: float
