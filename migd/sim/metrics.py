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
  makespan; a job keeps ``C * min(share, demand)`` slices busy (:mod:`migd.sim.jobs`).
* **allocated slices**: compute slices of the partitions jobs hold (a whole GPU
  for exclusive, the demand-weighted share for MPS) / all slices.
* **wasted slices**: time-weighted compute + memory slices of the committed MIG
  layout that no completion of it can ever use (seed 000), per GPU.
* **reconfiguration**: create/destroy operations and their seed 003 Table 1 seconds.
* **OOM loss**: GPU-seconds (GPU share x wall time) of runs killed by an OOM or
  restarted early by the forecast.
* **energy**: the integral of ``idle_w + slice_w * busy slices`` per GPU over the
  makespan; per completed job.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from migd.sim.engine import SimResult


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


def compute_metrics(result: SimResult) -> Metrics:
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
    )
