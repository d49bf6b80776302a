"""Hybrid MIG+MPS against exclusive, static MIG, migd's MIG and pure MPS on every mix.

    .venv/bin/python bench/hybrid_compare.py --seeds 3     # bench/results/hybrid.md

Every built-in workload runs under scheme A (size queue) with the calibrated MPS model
(:mod:`migd.policysim.interference`); the KIT rows are checked against [Voigtlaender] Table
2, and two multi-user mixes show what per-user MPS servers cost and that the hybrid
never puts two users' jobs in one server.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from migd.policysim.compare import compare
from migd.policysim.engine import PolicySimConfig, simulate
from migd.policysim.interference import fit_kit
from migd.policysim.jobs import WorkloadJob
from migd.policysim.metrics import Metrics, area_bounds, compute_metrics
from migd.policysim.policies import named_policy
from migd.policysim.workloads import WORKLOADS

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("exclusive", "static", "mps", "migd", "hybrid")
LABELS = {
    "exclusive (A)": "exclusive",
    "static-best (A)": "static MIG (best layout)",
    "mps (A)": "pure MPS",
    "migd (A)": "pure MIG (migd)",
    "hybrid (A)": "hybrid",
}
HEADLINE = ("kit", "ht1", "ht2", "ht3")


def users(jobs: Sequence[WorkloadJob], n: int) -> list[WorkloadJob]:
    """The same jobs owned by ``n`` users in turn (UID 1000, 1001, ...)."""
    return [replace(j, uid=1000 + i % n) for i, j in enumerate(jobs)]


def mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.fmean(finite) if finite else math.nan


def run_mix(
    name: str, jobs_by_seed: list[list[WorkloadJob]], config: PolicySimConfig
) -> dict[str, object]:
    rows: dict[str, list[Metrics]] = {}
    for jobs in jobs_by_seed:
        c = compare(jobs, workload=name, policies=POLICIES, queue="size", config=config,
                    keep_results=lambda p: False)  # fmt: skip
        for row in c.rows:
            if row.label in LABELS:
                rows.setdefault(row.label, []).append(row.metrics)
    bounds = [area_bounds(j, _geo(config), config.gpus * config.nodes, 1024) for j in jobs_by_seed]
    return {"rows": rows, "bounds": bounds}


def _geo(config: PolicySimConfig):  # type: ignore[no-untyped-def]
    from migd.core.catalog import geometry

    return geometry(config.model)


def multi_user_rows(
    name: str, jobs: list[WorkloadJob], config: PolicySimConfig
) -> list[tuple[str, Metrics]]:
    out = []
    for label, spec in (
        ("exclusive", named_policy("exclusive")),
        ("pure MPS, one server per user", named_policy("mps")),
        (
            "pure MPS, multi_user",
            replace(
                named_policy("mps"),
                scheduler=replace(named_policy("mps").scheduler, mps_multi_user=True),
            ),
        ),
        ("pure MIG (migd)", named_policy("migd")),
        ("hybrid", named_policy("hybrid")),
    ):
        out.append((label, compute_metrics(simulate(jobs, spec, config))))
    return out


Rows = dict[str, list[Metrics]]


def _ratio(rows: Rows, label: str, steady: bool) -> float:
    """Mean throughput of ``label`` over its seeds / exclusive's."""

    def avg(label: str) -> float:
        ms = rows.get(label, [])
        return mean([m.steady_throughput_per_h if steady else m.throughput_per_h for m in ms])

    return avg(label) / avg("exclusive (A)")


def fmt(x: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(x) else f"{x:.{digits}f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--only", help="comma-separated workloads")
    args = parser.parse_args(argv)
    names = list(WORKLOADS)
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    started = time.monotonic()
    lines = [
        "# Hybrid MIG+MPS against the pure modes",
        "",
        f"Made by `.venv/bin/python bench/hybrid_compare.py --seeds {args.seeds}` "
        "(queue scheme A, the calibrated MPS model of `migd.policysim.interference`, "
        "A100-40GB; seeds 1.."
        f"{args.seeds}, means). Throughput is completed jobs per hour of makespan "
        "against exclusive whole GPUs; *steady* counts only from the first completion to the "
        "last start "
        "(as [Voigtlaender] Table 2 cuts to the fully used part); turnaround is the "
        "median in minutes; *slice acc.* is slice-weighted acceptance; *breaches* are "
        "jobs that shared an MPS server with another user's job. *Bounds* are the "
        "slice-area bounds (`migd.policysim.metrics.area_bounds`): MIG = each job on its "
        "least-area profile, packed without gaps; shared = compute demand x runtime "
        "and MiB x runtime packed into the GPU. A dagger marks a run that did not "
        "complete every job.",
        "",
    ]
    summary: list[str] = [
        "| mix | exclusive | static best | pure MIG | pure MPS | hybrid | hybrid vs best pure "
        "| MIG bound | shared bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    detail: list[str] = []
    for name in names:
        spec = WORKLOADS[name]
        config = PolicySimConfig(model=spec.model, gpus=spec.gpus, nodes=spec.nodes)
        jobs_by_seed = [spec.build(s) for s in range(1, args.seeds + 1)]
        res = run_mix(name, jobs_by_seed, config)
        rows: dict[str, list[Metrics]] = res["rows"]  # type: ignore[assignment]
        base = mean([m.throughput_per_h for m in rows["exclusive (A)"]])

        def ratio(label: str, steady: bool = False, rows: Rows = rows) -> float:
            return _ratio(rows, label, steady)

        def dag(label: str, rows: Rows = rows) -> str:
            return "" if all(m.complete for m in rows.get(label, [])) else "†"

        bounds = res["bounds"]
        mig_b = mean([b.mig_per_h for b in bounds]) / base  # type: ignore[attr-defined]
        sh_b = mean([b.shared_per_h for b in bounds]) / base  # type: ignore[attr-defined]
        best_pure = max(ratio("mps (A)"), ratio("migd (A)"))
        hy = ratio("hybrid (A)")
        summary.append(
            f"| {name} | 1.00 | {fmt(ratio('static-best (A)'))}{dag('static-best (A)')} "
            f"| {fmt(ratio('migd (A)'))}{dag('migd (A)')} | {fmt(ratio('mps (A)'))}"
            f"{dag('mps (A)')} | **{fmt(hy)}**{dag('hybrid (A)')} "
            f"| {100 * (hy / best_pure - 1):+.1f} % | {fmt(mig_b)} | {fmt(sh_b)} |"
        )
        detail += [
            f"### {name}",
            "",
            f"{spec.description}. {args.seeds} seed(s); {config.gpus} GPU(s) x "
            f"{config.nodes} node(s).",
            "",
            "| policy | throughput | steady | turnaround p50 (min) | slice acc. | breaches "
            "| creates |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, title in LABELS.items():
            ms = rows.get(label, [])
            if not ms:
                continue
            detail.append(
                f"| {title} | {fmt(ratio(label))}{dag(label)} | {fmt(ratio(label, True))} "
                f"| {fmt(mean([m.turnaround_p50_s for m in ms]) / 60, 1)} "
                f"| {fmt(100 * mean([m.slice_acceptance for m in ms]), 1)} % "
                f"| {sum(m.isolation_breaches for m in ms)} "
                f"| {fmt(mean([float(m.creates) for m in ms]), 0)} |"
            )
        detail.append("")
        print(f"{name}: hybrid {hy:.2f}x, best pure {best_pure:.2f}x", file=sys.stderr)
    fit = fit_kit()
    calib = [
        "## The calibrated MPS model against [Voigtlaender]",
        "",
        f"KIT job demand d = {fit.demand} (fitted), contention kappa = {fit.model.kappa}, "
        f"server limit {fit.model.server_clients} clients.",
        "",
        "| source | figure | published | model | residual | fitted |",
        "|---|---|---|---|---|---|",
    ]
    for o in fit.observations:
        calib.append(
            f"| {o.source} | {o.what} | {o.value:.3f} | {o.predicted:.3f} "
            f"| {100 * o.residual:+.1f} % | {'yes' if o.fitted else 'no (check)'} |"
        )
    calib.append("")
    multi = [
        "## Several users (isolation)",
        "",
        "The KIT and Ht3 jobs owned by 4 users in turn (seed 1). MPS runs one server per "
        "user per device unless `multi_user`; only `multi_user` lets two users' jobs share "
        "a server, which is what *breaches* counts.",
        "",
        "| mix | policy | throughput | breaches |",
        "|---|---|---|---|",
    ]
    for name in ("kit", "ht3"):
        if name not in names:
            continue
        spec = WORKLOADS[name]
        config = PolicySimConfig(model=spec.model, gpus=spec.gpus, nodes=spec.nodes)
        rows4 = multi_user_rows(name, users(spec.build(1), 4), config)
        b = rows4[0][1].throughput_per_h
        for label, m in rows4:
            multi.append(
                f"| {name} x4 users | {label} | {fmt(m.throughput_per_h / b)}"
                f"{'' if m.complete else '†'} | {m.isolation_breaches} |"
            )
    multi.append("")
    elapsed = time.monotonic() - started
    text = "\n".join(
        [
            *lines,
            "## Throughput against exclusive (means over seeds)",
            "",
            *summary,
            "",
            *calib,
            *multi,
            "## Per mix",
            "",
            *detail,
            f"Wall time of this benchmark: {elapsed:.0f} s.",
            "",
        ]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hybrid.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
