"""Every knob of the node scheduler, as one value (the daemon builds it from its
configuration; the policy simulator from a named policy)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from migd.core.demand import DemandKey
from migd.core.hybrid import HybridPolicy
from migd.core.planner import PlannerPolicy
from migd.core.queueing import QueuePolicy


@dataclass
class SchedulerPolicy:
    planner: PlannerPolicy = field(default_factory=PlannerPolicy)
    queue: QueuePolicy = QueuePolicy.FIFO
    aging_s: float = 600.0
    starvation_s: float = 1800.0
    backfill: bool | None = None
    idle_policy: Literal["keep", "destroy", "timeout"] = "timeout"
    idle_timeout_s: float = 300.0
    demand_weighting: bool = False
    demand_prior: Mapping[DemandKey, float] = field(default_factory=dict)  # (model, ID)
    demand_half_life_s: float = 24 * 3600.0
    mps_reserve_mib: int = 1024
    mps_max_clients: int = 48
    mps_multi_user: bool = False
    # GPUs with mps_in_mig: the hybrid policy decides per request whether it shares and
    # sizes new MPS hosts (migd.core.hybrid); None: the fixed mps_profile rule.
    hybrid: HybridPolicy | None = None
