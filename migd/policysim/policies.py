"""The policies the simulator compares: each is a configuration of the same scheduler.

Nothing here places anything: a :class:`PolicySpec` only says how to configure
:class:`migd.core.scheduler.NodeScheduler` (GPU mode, planner and queue policy)
and whether the simulator pre-creates a static layout or forecasts memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from migd.core.forecast import ForecastPolicy
from migd.core.geometry import Geometry
from migd.core.gpus import GpuMode
from migd.core.hybrid import HybridPolicy
from migd.core.planner import GpuChoice, PlacementRule, PlannerPolicy
from migd.core.policy import SchedulerPolicy
from migd.core.queueing import QueuePolicy
from migd.core.states import describe, state_space
from migd.errors import InvalidRequest


@dataclass(frozen=True)
class PolicySpec:
    """One configuration of the node scheduler under test.

    Attributes:
        name: short name used in tables (``migd``, ``exclusive``, ``static[3]``...).
        gpu_mode: how every GPU is managed (MIG, MPS or exclusive).
        scheduler: the scheduler policy (planner, queue scheme, idle handling).
        static_layout: a full layout pre-created on every GPU (static MIG); the
            HTCondor-like matcher then offers jobs the smallest idle instance that
            holds them.
        forecast: restart growing jobs early when :mod:`migd.core.forecast` says they
            will not fit ([MIG-HT] §3.2.3).
        forecast_policy: thresholds of that forecast.
        forecast_sizing: what the restart asks for: ``point`` the partition that holds
            the point forecast of the peak ([MIG-HT]: "the slice that meets the memory
            requirement"), ``upper`` the one that holds its upper band
            (``Verdict.needed_mib``, which early in a run is far larger).
        start_order: ``driver``: placement rules that fall back on the driver's order
            see its observed default order; ``index``: the lowest free start first (seed
            001's "sequential" first-fit).
        node_order: how the pool's matcher offers a job to nodes: ``best-fit`` (the
            node advertising the least room that suffices) or ``first-fit`` (node index
            order, as [Siavashi]'s first-fit scans hosts).
        description: one line for the report.
    """

    name: str
    gpu_mode: GpuMode = GpuMode.MIG
    scheduler: SchedulerPolicy = field(default_factory=SchedulerPolicy)
    static_layout: tuple[tuple[str, int], ...] | None = None
    forecast: bool = False
    forecast_policy: ForecastPolicy = field(default_factory=ForecastPolicy)
    forecast_sizing: Literal["point", "upper"] = "point"
    start_order: Literal["driver", "index"] = "driver"
    node_order: Literal["best-fit", "first-fit"] = "best-fit"
    description: str = ""
    mps_in_mig: bool = False  # GPUs host MPS servers inside MIG instances (hybrid)

    def with_queue(self, queue: QueuePolicy) -> PolicySpec:
        """The same policy under another queue scheme ([MIG-HT] A = size, B = fifo)."""
        scheme = "A" if queue is QueuePolicy.SIZE else "B"
        base = self.name.split(" (")[0]
        return replace(
            self,
            name=f"{base} ({scheme})",
            scheduler=replace(self.scheduler, queue=queue),
        )


def _sched(queue: QueuePolicy, **planner: object) -> SchedulerPolicy:
    return SchedulerPolicy(planner=PlannerPolicy(**planner), queue=queue)  # type: ignore[arg-type]


POLICY_NAMES = (
    "exclusive",
    "static",
    "mps",
    "first-fit",
    "first-fit-seq",
    "mcc",
    "migd",
    "migd+demand",
    "migd-noff",
    "migd+forecast",
    "hybrid",
)


def named_policy(name: str, queue: QueuePolicy = QueuePolicy.SIZE) -> PolicySpec:
    """A policy by name (see :data:`POLICY_NAMES`; ``static`` needs :func:`static_policies`).

    Raises:
        InvalidRequest: unknown name.
    """
    scheme = "A" if queue is QueuePolicy.SIZE else "B"
    table: dict[str, PolicySpec] = {
        "exclusive": PolicySpec(
            "exclusive",
            GpuMode.EXCLUSIVE,
            SchedulerPolicy(queue=queue),
            description="HTCondor's default: one job per whole GPU (GpuMode.EXCLUSIVE)",
        ),
        "mps": PolicySpec(
            "mps",
            GpuMode.MPS,
            SchedulerPolicy(queue=queue),
            description="whole GPUs shared through MPS, admitted by memory (GpuMode.MPS)",
        ),
        "first-fit": PolicySpec(
            "first-fit",
            scheduler=_sched(queue, placement=PlacementRule.DRIVER, gpu_choice=GpuChoice.FIRST_FIT),
            description="dynamic MIG, driver's default start, lowest GPU first",
        ),
        "first-fit-seq": PolicySpec(
            "first-fit-seq",
            scheduler=_sched(queue, placement=PlacementRule.DRIVER, gpu_choice=GpuChoice.FIRST_FIT),
            start_order="index",
            node_order="first-fit",
            description="[Siavashi]'s FF: hosts, GPUs and starts in index order (dynamic MIG)",
        ),
        "mcc": PolicySpec(
            "mcc",
            scheduler=_sched(queue, placement=PlacementRule.MAX_CC),
            description="dynamic MIG, [Siavashi] MCC: most placements possible afterwards",
        ),
        "migd": PolicySpec(
            "migd",
            scheduler=_sched(queue),
            description="dynamic MIG, reachability placement + fission/fusion (default)",
        ),
        "migd+demand": PolicySpec(
            "migd+demand",
            scheduler=replace(_sched(queue), demand_weighting=True),
            description="migd with demand-weighted reachability",
        ),
        "migd-noff": PolicySpec(
            "migd-noff",
            scheduler=_sched(queue, fission_fusion=False),
            description="migd without fission/fusion (idle instances wait for the idle timeout)",
        ),
        "hybrid": PolicySpec(
            "hybrid",
            scheduler=replace(_sched(queue), hybrid=HybridPolicy()),
            mps_in_mig=True,
            description="migd + per-request MPS shares inside MIG instances sized to "
            "demand (migd.core.hybrid)",
        ),
        "migd+forecast": PolicySpec(
            "migd+forecast",
            scheduler=_sched(queue),
            forecast=True,
            description="migd, restarting growing jobs early on the memory forecast",
        ),
    }
    spec = table.get(name)
    if spec is None:
        raise InvalidRequest(
            f"unknown policy {name!r}", hint="policies: " + ", ".join(POLICY_NAMES)
        )
    return replace(spec, name=f"{spec.name} ({scheme})")


def static_policies(geo: Geometry, queue: QueuePolicy = QueuePolicy.SIZE) -> list[PolicySpec]:
    """One static-MIG policy per full layout of the ``classic`` set (19 on A100-40GB).

    Instances are never created or destroyed (``allow_create=False``,
    ``fission_fusion=False``, idle instances kept).
    """
    space = state_space(geo, "classic")
    scheme = "A" if queue is QueuePolicy.SIZE else "B"
    out = []
    for i, key in enumerate(sorted(space.full_states)):
        layout = describe(space, key)
        out.append(
            PolicySpec(
                f"static[{i}] ({scheme})",
                scheduler=SchedulerPolicy(
                    planner=PlannerPolicy(allow_create=False, fission_fusion=False),
                    queue=queue,
                    idle_policy="keep",
                ),
                static_layout=tuple((a.profile.name, a.start) for a in space.placements(key)),
                description=f"static MIG layout {layout}",
            )
        )
    return out
