"""Run several policies on one workload and summarise them side by side.

``static`` expands to one run per full layout of the ``classic`` set (19 on
A100-40GB); the comparison keeps the best and the median ("typical") layout,
ranked by jobs completed, then throughput.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from migd.core.catalog import geometry
from migd.core.queueing import QueuePolicy
from migd.errors import InvalidRequest
from migd.policysim.engine import PolicySimConfig, PolicySimResult, simulate
from migd.policysim.jobs import WorkloadJob
from migd.policysim.metrics import Metrics, compute_metrics
from migd.policysim.policies import POLICY_NAMES, PolicySpec, named_policy, static_policies

DEFAULT_POLICIES = (
    "exclusive",
    "static",
    "mps",
    "first-fit",
    "mcc",
    "migd",
    "migd+demand",
    "migd-noff",
)


@dataclass
class Row:
    """One line of a comparison: a policy (or static summary) and its numbers."""

    label: str
    description: str
    metrics: Metrics
    result: PolicySimResult | None = None


@dataclass
class Comparison:
    """All runs of one workload."""

    workload: str
    description: str
    assumptions: str
    config: PolicySimConfig
    jobs: int
    rows: list[Row] = field(default_factory=list)
    static_all: list[Row] = field(default_factory=list)
    baseline: str = ""

    def resolve(self, label: str) -> str:
        """``label``, or the same policy under the other queue scheme if only that ran."""
        labels = {r.label for r in self.rows}
        if label in labels:
            return label
        for alt in (label.replace("(A)", "(B)"), label.replace("(B)", "(A)")):
            if alt in labels:
                return alt
        return label

    def row(self, label: str) -> Row:
        for r in self.rows:
            if r.label == label:
                return r
        raise KeyError(label)

    def ratio(self, label: str, attr: str = "throughput_per_h") -> float:
        """``attr`` of ``label`` (or its other scheme) divided by the baseline's; NaN if none."""
        try:
            base = getattr(self.row(self.baseline).metrics, attr)
            value = getattr(self.row(self.resolve(label)).metrics, attr)
        except KeyError:
            return math.nan
        return float(value / base) if base else math.nan


def _queues(spec: str) -> list[QueuePolicy]:
    if spec == "both":
        return [QueuePolicy.SIZE, QueuePolicy.FIFO]
    if spec in ("size", "a", "A"):
        return [QueuePolicy.SIZE]
    if spec in ("fifo", "b", "B"):
        return [QueuePolicy.FIFO]
    raise InvalidRequest(f"unknown queue scheme {spec!r}", hint="size (A), fifo (B) or both")


def _step(
    on_step: Callable[[str, float], None], name: str, _now: float, ended: int, total: int
) -> None:
    on_step(name, ended / total if total else 1.0)


def _static_rank(row: Row) -> tuple[int, float]:
    return (-row.metrics.completed, -row.metrics.throughput_per_h)


def expand_policies(
    names: Sequence[str], queues: Sequence[QueuePolicy], model: str
) -> list[PolicySpec]:
    """Policy names (with ``static`` and queue schemes) to concrete policies.

    Raises:
        InvalidRequest: an unknown policy name.
    """
    out: list[PolicySpec] = []
    for name in names:
        if name not in POLICY_NAMES:
            raise InvalidRequest(
                f"unknown policy {name!r}", hint="policies: " + ", ".join(POLICY_NAMES)
            )
        for queue in queues:
            if name == "static":
                out.extend(static_policies(geometry(model), queue))
            else:
                out.append(named_policy(name, queue))
    return out


def compare(
    jobs: Sequence[WorkloadJob],
    *,
    workload: str = "custom",
    description: str = "",
    assumptions: str = "",
    policies: Sequence[str] = DEFAULT_POLICIES,
    queue: str = "both",
    config: PolicySimConfig | None = None,
    keep_results: Callable[[PolicySpec], bool] | None = None,
    on_progress: Callable[[str], None] | None = None,
    on_step: Callable[[str, float], None] | None = None,
) -> Comparison:
    """Simulate every policy on ``jobs``.

    Args:
        jobs: the workload.
        workload, description, assumptions: carried into the report.
        policies: names from :data:`migd.policysim.policies.POLICY_NAMES`.
        queue: ``size`` ([MIG-HT] scheme A), ``fifo`` (scheme B) or ``both``.
        config: hardware and simulation knobs.
        keep_results: which runs keep their raw result (timelines for plots); default
            the non-static ones.
        on_progress: called with the policy name after each run.
        on_step: called now and then *during* a run with the policy name and the
            fraction of its jobs that have ended (a progress bar for long runs).

    Raises:
        InvalidRequest: unknown policy or queue scheme.
    """
    config = config or PolicySimConfig()
    specs = expand_policies(policies, _queues(queue), config.model)
    keep = keep_results or (lambda spec: spec.static_layout is None)
    comparison = Comparison(workload, description, assumptions, config, len(jobs))
    static_rows: dict[str, list[Row]] = {}
    for spec in specs:
        step = None
        if on_step is not None:
            step = functools.partial(_step, on_step, spec.name)
        result = simulate(jobs, spec, config, progress=step)
        row = Row(
            spec.name, spec.description, compute_metrics(result), result if keep(spec) else None
        )
        if spec.static_layout is not None:
            scheme = spec.name.rsplit(" ", 1)[-1]
            static_rows.setdefault(scheme, []).append(row)
            comparison.static_all.append(row)
        else:
            comparison.rows.append(row)
        if on_progress is not None:
            on_progress(spec.name)
    for scheme, rows in static_rows.items():
        ranked = sorted(rows, key=_static_rank)
        best, median = ranked[0], ranked[(len(ranked) - 1) // 2]
        comparison.rows.append(
            Row(
                f"static-best {scheme}",
                f"best of {len(rows)} static layouts: {best.description.split('layout ')[-1]}",
                best.metrics,
                best.result,
            )
        )
        comparison.rows.append(
            Row(
                f"static-median {scheme}",
                f"median of {len(rows)} static layouts: {median.description.split('layout ')[-1]}",
                median.metrics,
                median.result,
            )
        )
    order: dict[str, int] = {}
    for name in ("exclusive", "static-best", "static-median", *POLICY_NAMES):
        order.setdefault(name, len(order))
    comparison.rows.sort(key=lambda r: (order.get(r.label.split(" ")[0], 99), r.label))
    labels = [r.label for r in comparison.rows]
    # exclusive whole GPUs (HTCondor's default) when it ran; otherwise the first row,
    # and the tables say which (``vs <baseline>``)
    comparison.baseline = next(
        (x for x in ("exclusive (B)", "exclusive (A)") if x in labels), labels[0] if labels else ""
    )
    return comparison


def count_runs(policies: Sequence[str], queue: str, model: str) -> int:
    """How many simulations :func:`compare` will run (for a progress bar)."""
    return len(expand_policies(policies, _queues(queue), model))
