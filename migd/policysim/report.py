"""Markdown reports and PNG plots of simulation comparisons.

Plots need matplotlib (``pip install migd[sim]``); without it the Markdown is
still written and says which plots were skipped. matplotlib is imported lazily
(and untyped) so the simulator itself never depends on it.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from migd.policysim.compare import Comparison, Row
from migd.policysim.engine import PolicySimResult
from migd.policysim.metrics import Metrics

# -- formatting ---------------------------------------------------------------------------------


def fmt_duration(seconds: float) -> str:
    """``4521.3`` -> ``"1h 15m"``, ``312`` -> ``"5m 12s"``, ``9.5`` -> ``"9.5 s"``."""
    if seconds is None or math.isnan(seconds):
        return "-"
    if seconds >= 3600:
        return f"{int(seconds // 3600)}h {int(seconds % 3600 // 60):02d}m"
    if seconds >= 60:
        return f"{int(seconds // 60)}m {int(seconds % 60):02d}s"
    return f"{seconds:.1f} s"


def _num(value: float, digits: int = 2) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def _pct(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.0f} %"


INCOMPLETE = "†"


def ratio_cell(comparison: Comparison, row: Row) -> str:
    """Throughput ``1.49x``, with a dagger when the row did not complete every job."""
    cell = _ratio(comparison.ratio(row.label))
    return cell if row.metrics.complete else f"{cell} {INCOMPLETE}"


def comparison_table(comparison: Comparison) -> str:
    """The full policy table of one workload, Markdown (incomplete runs marked †)."""
    head = (
        f"| Policy | Done | Throughput (jobs/h) | vs {comparison.baseline} | Makespan "
        "| Turnaround p50 / p95 "
        "| Accepted | First placement mean / p95 | Compute util | Allocated | Wasted slices "
        "| Creates / destroys (s) | OOM kills + early restarts (GPU-s lost) | Energy/job (kJ) "
        "| Steady (jobs/h) | Slice-weighted acceptance | Isolation breaches |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for row in comparison.rows:
        m = row.metrics
        lines.append(
            f"| {row.label} | {m.completed}/{m.jobs} | {_num(m.throughput_per_h, 1)} "
            f"| {ratio_cell(comparison, row)} | {fmt_duration(m.makespan_s)} "
            f"| {fmt_duration(m.turnaround_p50_s)} / {fmt_duration(m.turnaround_p95_s)} "
            f"| {_pct(m.acceptance)} "
            f"| {fmt_duration(m.first_placement_mean_s)} / {fmt_duration(m.first_placement_p95_s)} "
            f"| {_pct(m.compute_util)} | {_pct(m.allocated_util)} | {_num(m.wasted_slices, 2)} "
            f"| {m.creates} / {m.destroys} ({m.reconfig_s:.1f}) "
            f"| {m.oom_kills} + {m.forecast_kills} ({m.oom_lost_gpu_s:.0f}) "
            f"| {_num(m.energy_per_job_kj, 1)} | {_num(m.steady_throughput_per_h, 1)} "
            f"| {_pct(m.slice_acceptance)} | {m.isolation_breaches} |"
        )
    text = head + "\n".join(lines) + "\n"
    if any(not r.metrics.complete for r in comparison.rows):
        text += (
            f"\n{INCOMPLETE} the policy did not complete every job (refused, failed or "
            "unfinished ones): its throughput counts only the jobs it ran, over their "
            "makespan, and is not comparable with a run that completed them all.\n"
        )
    return text


DEFINITIONS = """\
**Definitions.** *Throughput*: completed jobs per hour of makespan (first submission
to last completion); *vs ...*: divided by the baseline's, the exclusive whole-GPU
policy (HTCondor's default) when it ran, else the first policy of the table.
*Turnaround*: completion - submission. *Accepted*: jobs that ever started. *First
placement*: first start - submission (includes MIG instance creation).
*Compute util*: time-weighted busy compute slices / all slices, where a job keeps
`C x min(share, demand)` slices busy. *Allocated*: slices of the partitions jobs hold
(a whole GPU for exclusive). *Wasted slices*: compute + memory slices of the committed
MIG layout that no completion can ever use ([Turkkan]), per GPU, time-weighted.
*Creates / destroys*: NVML operations and their [Villarrubia] Table 1 seconds.
*OOM kills + early restarts*: runs killed by running out of memory or restarted early by
the forecast, with the GPU-seconds (GPU share x time) they lost. *Energy/job*: idle
watts per GPU plus watts per busy compute slice, integrated over the makespan, per
completed job. *Steady*: completed jobs per hour from the first completion to the
last start (the fully used part, as [Voigtlaender] Table 2 cuts). *Slice-weighted
acceptance*: slice-hours (compute slices x runtime alone) of jobs that ran / of all
jobs. *Isolation breaches*: runs that shared an MPS server with another user's job.
"""


def partitions_section(rows: Sequence[Row]) -> str:
    """Where each policy ran its jobs (``mps@<profile>``: a share of an MPS server
    inside a MIG instance of that profile, the hybrid's decision), per run."""
    lines = []
    for row in rows:
        if row.result is None:
            continue
        counts: dict[str, int] = {}
        for record in row.result.records:
            for where in record.profiles:
                counts[where] = counts.get(where, 0) + 1
        parts = ", ".join(f"{n} x {k}" for k, n in sorted(counts.items(), key=lambda x: -x[1]))
        lines.append(f"* **{row.label}**: {parts or 'nothing ran'}")
        reasons: dict[str, int] = {}
        for record in row.result.records:
            for why in record.hybrid:
                # the same decision for jobs of different MiB reads the same
                key = re.sub(r"\d+ MiB", "N MiB", why)
                reasons[key] = reasons.get(key, 0) + 1
        for why, n in sorted(reasons.items(), key=lambda x: -x[1])[:6]:
            lines.append(f"  * {n} x hybrid: {why}")
    return "\n".join(lines) + "\n"


def policy_descriptions(rows: Sequence[Row]) -> str:
    seen: dict[str, str] = {}
    for row in rows:
        base = row.label.split(" (")[0]
        seen.setdefault(base, row.description)
    return "\n".join(f"* **{name}**: {desc}" for name, desc in seen.items()) + "\n"


# -- plots --------------------------------------------------------------------------------------


def pyplot() -> Any | None:
    """matplotlib's pyplot with the Agg backend, or ``None`` when it is not installed."""
    try:
        mpl = importlib.import_module("matplotlib")
    except ImportError:
        return None
    mpl.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def _hours(seconds: float) -> float:
    return seconds / 3600.0


def plot_utilisation(result: PolicySimResult, path: Path, title: str = "") -> bool:
    """Busy compute slices over time, one line per GPU. ``False`` without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    end = max((r.end_s or 0.0) for r in result.records) or result.end_s
    scale, unit = (_hours, "h") if end > 3 * 3600 else ((lambda s: s / 60.0), "min")
    for (node, gpu), line in sorted(result.timelines.items())[:16]:
        xs = [scale(t) for t, *_ in line] + [scale(end)]
        ys = [busy for _, busy, *_ in line] + [line[-1][1]]
        label = f"GPU {gpu}" if result.config.nodes == 1 else f"n{node}/GPU {gpu}"
        ax.step(xs, ys, where="post", linewidth=1.0, label=label)
    ax.set_xlim(0, scale(end))
    ax.set_ylim(0, result.geometry.compute_slices + 0.3)
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel("busy compute slices")
    ax.set_title(title or f"{result.policy.name}: utilisation per GPU", fontsize=10)
    if len(result.timelines) <= 8:
        ax.legend(fontsize=7, ncol=4, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_slice_map(
    result: PolicySimResult, path: Path, node: int = 0, gpu: int = 0, title: str = ""
) -> bool:
    """Which job held which memory slices of one GPU over time. ``False`` without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    patches = importlib.import_module("matplotlib.patches")
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=100)
    end = max((r.end_s or 0.0) for r in result.records) or result.end_s
    scale, unit = (_hours, "h") if end > 3 * 3600 else ((lambda s: s / 60.0), "min")
    kinds = sorted({s.what for s in result.spans if s.kind == "job"})
    cmap = plt.get_cmap("tab10")
    colour = {k: cmap(i % 10) for i, k in enumerate(kinds)}
    for span in result.spans:
        if span.node != node or span.gpu != gpu:
            continue
        x0, width = scale(span.start_s), scale(span.end_s) - scale(span.start_s)
        if span.kind == "instance":
            ax.add_patch(
                patches.Rectangle(
                    (x0, span.unit_start + 0.04),
                    width,
                    span.units - 0.08,
                    fill=False,
                    edgecolor="0.35",
                    linewidth=0.6,
                )
            )
        else:
            hatch = "//" if span.label in ("oom", "forecast") else None
            ax.add_patch(
                patches.Rectangle(
                    (x0, span.unit_start + 0.1),
                    width,
                    span.units - 0.2,
                    facecolor=colour[span.what],
                    alpha=0.75,
                    edgecolor="none",
                    hatch=hatch,
                )
            )
    ax.set_xlim(0, scale(end))
    ax.set_ylim(0, result.geometry.units)
    ax.set_xlabel(f"time ({unit})")
    ax.set_ylabel("memory slice (placement unit)")
    ax.set_title(title or f"{result.policy.name}: slice map of GPU {gpu}", fontsize=10)
    handles = [patches.Patch(color=colour[k], label=k) for k in kinds[:10]]
    if handles:
        ax.legend(handles=handles, fontsize=7, ncol=min(5, len(handles)), loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_comparison(
    comparisons: Sequence[Comparison], labels: Sequence[str], path: Path, title: str = ""
) -> bool:
    """Throughput relative to each comparison's baseline, one group of bars per workload."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(comparisons) + 3), 3.6), dpi=100)
    width = 0.8 / max(1, len(labels))
    cmap = plt.get_cmap("tab10")
    for j, label in enumerate(labels):
        xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(comparisons))]
        ys = [c.ratio(label) for c in comparisons]
        ys = [0.0 if math.isnan(y) else y for y in ys]
        ax.bar(xs, ys, width=width, label=label, color=cmap(j % 10))
    ax.axhline(1.0, color="0.3", linewidth=0.8)
    ax.set_xticks(range(len(comparisons)))
    ax.set_xticklabels([c.workload for c in comparisons])
    bases = sorted({c.baseline.split(" (")[0] for c in comparisons if c.baseline})
    ax.set_ylabel(f"throughput vs {' / '.join(bases) or 'baseline'}")
    ax.set_title(title or "policy comparison", fontsize=10, pad=22)
    ax.legend(
        fontsize=7, ncol=len(labels), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_policy_bars(comparison: Comparison, path: Path, title: str = "") -> bool:
    """One workload: throughput and energy per job of every policy, relative to the baseline."""
    plt = pyplot()
    if plt is None:
        return False
    rows = comparison.rows
    fig, axes = plt.subplots(1, 2, figsize=(8, 0.28 * len(rows) + 1.4), dpi=100, sharey=True)
    names = [r.label for r in rows]
    ys = list(range(len(rows)))
    thr = [comparison.ratio(n) for n in names]
    energy = [comparison.ratio(n, "energy_per_job_kj") for n in names]
    for ax, values, what in ((axes[0], thr, "throughput"), (axes[1], energy, "energy per job")):
        clean = [0.0 if math.isnan(v) else v for v in values]
        colours = ["tab:green" if n.startswith("migd") else "tab:gray" for n in names]
        ax.barh(ys, clean, color=colours)
        ax.axvline(1.0, color="0.3", linewidth=0.8)
        ax.set_xlabel(f"{what} vs {comparison.baseline}")
        for y, v, row in zip(ys, clean, rows, strict=True):
            note = (
                ""
                if row.metrics.completed == row.metrics.jobs
                else (f" ({row.metrics.jobs - row.metrics.completed} not run)")
            )
            ax.text(v, y, f" {v:.2f}{note}", va="center", fontsize=7)
    axes[0].set_yticks(ys)
    axes[0].set_yticklabels(names, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(title or f"{comparison.workload}: policies vs {comparison.baseline}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# -- the report -----------------------------------------------------------------------------------


def _pick(comparison: Comparison, prefer: Sequence[str]) -> Row | None:
    for label in prefer:
        for row in comparison.rows:
            if row.label == label and row.result is not None:
                return row
    return next((r for r in comparison.rows if r.result is not None), None)


def write_report(
    comparison: Comparison,
    out_dir: Path,
    *,
    plots: bool = True,
    command: str = "",
) -> Path:
    """Write ``report.md`` (and PNGs) for one comparison into ``out_dir``; return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = comparison.config
    lines = [
        f"# migd simulation: {comparison.workload}",
        "",
        comparison.description or "",
        "",
        f"*Assumptions*: {comparison.assumptions}" if comparison.assumptions else "",
        "",
        f"Hardware: {cfg.nodes} node(s) x {cfg.gpus} {cfg.model}, profile set `{cfg.profiles}`; "
        "reconfiguration times: [Villarrubia] Table 1; "
        f"{comparison.jobs} jobs.",
    ]
    if command:
        lines += ["", f"Reproduce: `{command}`"]
    lines += ["", "## Policy comparison", "", comparison_table(comparison), DEFINITIONS]
    lines += ["## Policies", "", policy_descriptions(comparison.rows)]
    lines += ["## Where jobs ran", "", partitions_section(comparison.rows)]
    if comparison.static_all:
        lines += [
            "## Static layouts",
            "",
            "| Layout | Done | Throughput (jobs/h) |",
            "|---|---:|---:|",
        ]
        for row in comparison.static_all:
            m: Metrics = row.metrics
            lines.append(
                f"| {row.label}: {row.description.split('layout ')[-1]} | {m.completed}/{m.jobs} "
                f"| {_num(m.throughput_per_h, 1)} |"
            )
        lines.append("")
    notes = [n for r in comparison.rows if r.result is not None for n in r.result.notes]
    if notes:
        lines += ["## Notes", "", *sorted({f"* {n}" for n in notes}), ""]
    lines += ["## Plots", ""]
    if not plots:
        lines.append("Plots were not requested (`--no-plots`).")
    else:
        made: list[str] = []
        if plot_policy_bars(comparison, out_dir / "compare.png"):
            made.append("![policy comparison](compare.png)")
            picked = _pick(comparison, ["migd (A)", "migd (B)", "migd+forecast (A)"])
            if picked is not None and picked.result is not None:
                plot_utilisation(picked.result, out_dir / "utilisation.png")
                plot_slice_map(picked.result, out_dir / "slicemap.png")
                made += ["![utilisation per GPU](utilisation.png)", "![slice map](slicemap.png)"]
            lines += made
        else:
            lines.append("Plots skipped: matplotlib is not installed (`pip install 'migd[sim]'`).")
    path = out_dir / "report.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path
