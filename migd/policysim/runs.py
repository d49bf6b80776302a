"""Run arithmetic: how fast a job runs on what its lease holds, and where it stops.

A :class:`Run` is one attempt of a job on its partition: its share of the GPU, its
rate (:mod:`migd.policysim.jobs`), its progress, and where it ends early (OOM, or the
forecast restarting it: :class:`StopPoints`). What the partition is comes from the GPU's
mode driver (:meth:`migd.core.gpu_modes.GpuModeOps.holding`), so nothing here branches on
a GPU's mode. Pure arithmetic over records: no events, no scheduler calls.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

from migd.core.forecast import Forecaster, MemorySample
from migd.core.gpu_modes import Holding
from migd.core.restart import restart_size
from migd.policysim.interference import MpsInterference
from migd.policysim.jobs import WorkloadJob, busy_fraction, demand_of, runtime_at
from migd.policysim.policies import PolicySpec
from migd.policysim.records import Attempt, Span

Stop = Literal["done", "oom", "forecast"]


@dataclass
class Run:
    """One attempt of a job running on its partition, from its start to its end."""

    attempt: Attempt
    node: int
    gpu: int
    mode: str  # the lease's mode as granted (``mig``, ``mps``, ``exclusive``): the slice map's
    holding: Holding  # what it holds (the mode driver says)
    share: float
    rate: float
    progress: float
    last_s: float
    start_s: float
    stop_progress: float
    stop: Stop
    needed_mib: int
    limit_mib: int
    busy: float = 0.0
    alloc_slices: float = 0.0
    gpu_s: float = 0.0
    version: int = 0
    label: str = ""
    profile: str | None = None
    unit_start: int = 0
    units: int = 0
    host: int = -1  # MPS: start of the MIG instance hosting the server, -1 whole GPU
    host_slices: int = 0  # and its compute slices
    uid: int = 0

    @property
    def own_instance(self) -> bool:
        """It holds a MIG instance of its own (not a share, not a whole GPU)."""
        return self.holding.profile is not None and not self.holding.shared

    @property
    def in_instance(self) -> bool:
        """It runs in a MIG instance (its own, or an MPS host), whose idle time counts."""
        return self.holding.profile is not None

    def shares_device(self, other: Run) -> bool:
        """Both are MPS clients of the same server (the same GPU, the same host)."""
        return (
            self.holding.shared
            and other.holding.shared
            and (self.node, self.gpu, self.host) == (other.node, other.gpu, other.host)
        )

    def advance(self, now_s: float) -> None:
        """Progress up to ``now_s`` at the current rate."""
        dt = now_s - self.last_s
        if dt > 0:
            self.progress += dt * self.rate
            self.gpu_s += dt * self.share
            self.last_s = now_s

    def end_s(self, now_s: float) -> float:
        """When it stops at the current rate (it has advanced to ``now_s``)."""
        return now_s + max(0.0, self.stop_progress - self.progress) / self.rate

    def span(self, lease_id: str, end_s: float, how: str) -> Span:
        """This run on the slice map, from its start to ``end_s``, ended ``how``."""
        return Span(
            self.node,
            self.gpu,
            self.label,
            self.unit_start,
            self.units,
            self.start_s,
            end_s,
            "job",
            how,
            lease_id,
            self.profile or self.mode,
        )


class StopPoints:
    """Where a job's run ends early on a limit: the iteration its memory outgrows it
    (OOM), or, with the forecast on, the first iteration the forecaster fires, fed one
    sample per iteration with the horizon the wrapper would pass. Memoised per job and
    limit: a job restarts on a few limits only."""

    def __init__(self, policy: PolicySpec) -> None:
        self.policy = policy
        self._cache: dict[tuple[str, int, bool], tuple[int | None, Stop, int]] = {}

    def __call__(self, job: WorkloadJob, limit_mib: int) -> tuple[int | None, Stop, int]:
        """(iteration, why, MiB the forecast wants) for a run with ``limit_mib``."""
        growth = job.growth
        if growth is None:
            return None, "done", 0
        key = (job.job_id, limit_mib, self.policy.forecast)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        oom = growth.first_over(limit_mib)
        result: tuple[int | None, Stop, int] = (
            (oom, "oom", 0) if oom is not None else (None, "done", 0)
        )
        if self.policy.forecast:
            forecaster = Forecaster(self.policy.forecast_policy)
            # what the wrapper passes: the job's declared MigdHorizon, or none (then the
            # forecaster looks as far ahead as it has observed)
            horizon = job.horizon
            until = oom if oom is not None else growth.iterations
            for i in range(until):
                forecaster.observe(MemorySample(i, used_mib=growth.series[i]))
                verdict = forecaster.verdict(limit_mib, horizon=horizon)
                if verdict.fire:
                    needed = verdict.needed_mib
                    if self.policy.forecast_sizing == "point":
                        needed = self.policy.forecast_policy.needed_mib(verdict.predicted_peak_mib)
                    result = (i, "forecast", needed)
                    break
        self._cache[key] = result
        return result


def new_run(
    attempt: Attempt,
    *,
    node: int,
    gpu: int,
    mode: str,
    holding: Holding,
    limit_mib: int,
    compute: int,
    units: int,
    stops: StopPoints,
    now_s: float,
) -> tuple[Run, str]:
    """The run of ``attempt`` starting now on what its lease holds, and the label of
    that partition for the job's record (profile, ``mps@profile``, or the mode).

    On a MIG instance (its own or an MPS host) the job gets the instance's compute
    slices' share of the GPU (an MPS client's share is set by :func:`rebalance`),
    elsewhere the whole GPU; ``compute`` and ``units`` are the GPU's slices.
    """
    job = attempt.job
    share, alloc = 1.0, float(compute)
    unit_start, span_units, label = 0, units, str(mode)  # a plain str, like profile names
    host = -1  # the MIG instance an MPS share runs in (start), -1: the whole GPU
    prof = holding.profile
    if prof is not None:
        share = prof.compute_slices / compute
        alloc = float(prof.compute_slices)
        unit_start, span_units, label = holding.start, prof.memory_slices, prof.name
        if holding.shared:
            host, label = holding.start, f"mps@{prof.name}"
    stop_iter, stop, needed = stops(job, limit_mib)
    stop_progress = 1.0
    if stop_iter is not None and job.growth is not None:
        stop_progress = (stop_iter + 1) / job.growth.iterations
    run = Run(
        attempt=attempt,
        node=node,
        gpu=gpu,
        mode=mode,
        holding=holding,
        share=share,
        rate=1.0 / runtime_at(job, share, compute),
        progress=0.0,
        last_s=now_s,
        start_s=now_s,
        stop_progress=stop_progress,
        stop=stop,
        needed_mib=needed,
        limit_mib=limit_mib,
        busy=busy_fraction(job, share, compute),
        alloc_slices=alloc,
        label=job.kind or job.job_id,
        unit_start=unit_start,
        units=span_units,
        profile=prof.name if prof is not None and not holding.shared else None,
        host=host,
        host_slices=int(alloc) if host >= 0 else 0,
        uid=job.uid,
    )
    return run, label


def rebalance(
    members: list[tuple[str, Run]], model: MpsInterference, compute: int, now_s: float
) -> Iterable[tuple[str, Run]]:
    """Share one MPS device among its clients (:mod:`migd.policysim.interference`).

    The device is the whole GPU or the MIG instance hosting the server, whose compute
    slices' share of the GPU it offers. Yields the runs whose speed changed (advanced to
    ``now_s`` and given their new rate): their end events must be scheduled again.
    """
    if not members:
        return
    capacity = 1.0
    if members[0][1].host >= 0:
        capacity = members[0][1].host_slices / compute
    demands = [demand_of(r.attempt.job, compute) for _, r in members]
    shares = model.shares(demands, capacity)
    for (lid, run), share in zip(members, shares, strict=True):
        if share == run.share and run.version > 0:
            continue  # its speed did not change: its end event stands
        run.advance(now_s)
        run.share = share
        run.rate = 1.0 / runtime_at(run.attempt.job, run.share, compute)
        run.busy = run.share
        run.alloc_slices = run.share * compute
        yield lid, run


def interference_model(base: MpsInterference, flat_extra: float) -> MpsInterference:
    """The configured model with ``mps_interference`` added to its flat slowdown."""
    return replace(base, flat=base.flat + flat_extra) if flat_extra else base


def next_size(run: Run, room: tuple[tuple[int, ...], int]) -> int | None:
    """Memory to ask for on restart, by the wrapper's rule (``room``: the mode driver's
    :meth:`~migd.core.gpu_modes.GpuModeOps.restart_room`); ``None``: nothing bigger."""
    sizes, largest = room
    size = restart_size(
        run.limit_mib,
        ladder=bool(sizes),
        largest_mib=largest,
        needed_mib=run.needed_mib if run.stop == "forecast" else None,
        sizes=list(sizes),
    )
    return size.request_mib
