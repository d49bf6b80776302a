"""The simulator's records and configuration: what goes in and what comes out.

:class:`PolicySimConfig` (the simulated hardware and the simulation's knobs), an
:class:`Attempt` (one submission of a job), a :class:`JobRecord` (what happened to a
job), a :class:`Span` (an interval on the slice map) and the raw
:class:`PolicySimResult` that :mod:`migd.policysim.metrics` turns into numbers. Every
other module of the simulator imports these; this one imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from migd.core.geometry import Geometry
from migd.errors import InvalidRequest
from migd.policysim.interference import CALIBRATED, MpsInterference
from migd.policysim.jobs import PowerModel, WorkloadJob
from migd.policysim.policies import PolicySpec

Outcome = Literal["completed", "rejected", "failed", "unfinished"]

#: Nodes a simulated pool may have (the pool-scale benchmark runs 1,000).
MAX_NODES = 4096


@dataclass(frozen=True)
class PolicySimConfig:
    """The simulated hardware and the knobs of the simulation itself.

    Attributes:
        model: catalog model of every GPU (``A100-40GB``...).
        gpus: GPUs per node (1-8).
        nodes: nodes in the pool (1: the node's own queue orders requests; more: the
            matcher does, with the policy's queue scheme).
        profiles: profile set of the MIG state machine (``classic`` as in the papers).
        power: power model; ``None`` picks :meth:`PowerModel.for_model`.
        mps_interference: extra flat slowdown of every MPS client while two or more
            share a device, on top of ``interference`` (0: the calibrated model alone).
        interference: how MPS clients share a device (a whole GPU or a MIG instance
            hosting MPS); :mod:`migd.policysim.interference`, calibrated to [Voigtlaender].
        ad_latency_s: in a pool, seconds from a node freeing GPU memory (a job's end,
            an idle teardown) until the matcher sees it in the node's ad: the real
            pool's ``migctl condor-ad --watch`` put a freed A100 in the collector
            0.8-1.9 s after the release (docs/htcondor-notes.md (r)); 1.4 s is the
            median of those runs. A node's ad that shrinks (a job placed on it) is
            seen at once, as the startd updates the collector when a slot is
            claimed. 0: every change is seen at once (the model before it was
            compared with the pool). Static layouts and single nodes ignore it.
        max_time_s: stop the simulation at this simulated time.
        check_invariants: assert capacity and layout invariants after every event
            (tests; slows the run down).
        owner_uid_default: UID of jobs that do not name one.
    """

    model: str = "A100-40GB"
    gpus: int = 1
    nodes: int = 1
    profiles: str = "classic"
    power: PowerModel | None = None
    mps_interference: float = 0.0
    interference: MpsInterference = CALIBRATED
    ad_latency_s: float = 1.4
    max_time_s: float = 365 * 86400.0
    check_invariants: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.gpus <= 8:
            raise InvalidRequest(f"gpus per node must be 1-8, got {self.gpus}")
        if not 1 <= self.nodes <= MAX_NODES:
            raise InvalidRequest(f"nodes must be 1-{MAX_NODES}, got {self.nodes}")
        if self.mps_interference < 0:
            raise InvalidRequest("mps_interference must not be negative")
        if self.ad_latency_s < 0:
            raise InvalidRequest("ad_latency_s must not be negative")


@dataclass
class Attempt:
    """One submission of a job (the first, or a restart after OOM)."""

    job: WorkloadJob
    number: int
    memory_mib: int
    min_compute: int
    submit_s: float
    wait_s: float | None

    @property
    def lease_id(self) -> str:
        return self.job.job_id if self.number == 0 else f"{self.job.job_id}#{self.number}"


@dataclass
class JobRecord:
    """What happened to one job, over all its attempts."""

    job: WorkloadJob
    attempts: int = 0
    first_start_s: float | None = None
    end_s: float | None = None
    outcome: Outcome = "unfinished"
    reason: str = ""
    oom_kills: int = 0
    forecast_kills: int = 0
    lost_gpu_s: float = 0.0  # GPU-seconds (share x time) of runs killed by OOM or forecast
    lost_wall_s: float = 0.0
    profiles: list[str] = field(default_factory=list)  # what each attempt ran on
    hybrid: list[str] = field(default_factory=list)  # the hybrid's reason per attempt

    @property
    def turnaround_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.job.submit_s


@dataclass(frozen=True)
class Span:
    """An interval on one GPU for the slice map: an instance or a job run.

    ``what`` is the profile name of an instance, the job kind of a run. ``label`` is
    how it ended: ``destroyed`` or ``open`` (instances), ``done``, ``oom``,
    ``forecast`` or ``unfinished`` (runs). Runs also name their ``job`` (lease id)
    and ``partition`` (profile name, ``mps`` or ``exclusive``).
    """

    node: int
    gpu: int
    what: str
    unit_start: int
    units: int
    start_s: float
    end_s: float
    kind: Literal["instance", "job"]
    label: str = ""
    job: str = ""
    partition: str = ""


@dataclass
class ReconfigStats:
    creates: int = 0
    destroys: int = 0
    create_s: float = 0.0
    destroy_s: float = 0.0
    works: int = 0


@dataclass
class PolicySimResult:
    """Raw output of one run; :mod:`migd.policysim.metrics` turns it into numbers."""

    policy: PolicySpec
    config: PolicySimConfig
    geometry: Geometry
    records: list[JobRecord]
    end_s: float
    timelines: dict[tuple[int, int], list[tuple[float, float, float, float, float]]]
    spans: list[Span]
    reconfig: ReconfigStats
    power: PowerModel
    events: int
    max_queue: int
    notes: list[str] = field(default_factory=list)
    isolation_breaches: int = 0  # runs that shared an MPS server with another user's job


def index_order(geo: Geometry) -> Geometry:
    """``geo`` with every profile's default placement order sorted by start.

    [Siavashi]'s first-fit baseline assigns instances "sequentially" (the lowest free
    start first) instead of the driver's observed order (A100 1g: 6, 4, 5, 0, ...).
    """
    profiles = tuple(replace(p, default_order=tuple(sorted(p.default_order))) for p in geo.profiles)
    # the lookup tables are rebuilt from the new profiles, never shared with ``geo``
    return replace(geo, profiles=profiles)


__all__ = [
    "MAX_NODES",
    "Attempt",
    "JobRecord",
    "Outcome",
    "PolicySimConfig",
    "PolicySimResult",
    "ReconfigStats",
    "Span",
    "index_order",
]
