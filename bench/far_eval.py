"""FAR ([Villarrubia]) against the area lower bound, and its planning time.

For each task configuration of [Villarrubia] §6.3 (PoorScaling, MixedScaling,
GoodScaling with WideTimes) and batch size n, plans ``--runs`` random batches
with ``migd.policysim.far.plan_batch`` and reports the mean of
``rho = makespan / (sum_i min_s s * t_i(s) / 7)`` next to the paper's Table 4,
for the paper-faithful variant and migd's extended one, with no memory-bound tasks
(p_sup = 0, the setting that reproduces Table 4) and with Figure 11's p_sup = 0.5,
plus how far FAR as published lands from Table 4 for other p_sup. Also: the planning
time for 100 tasks, a stronger lower bound, and how far migd's *online* scheduler
(simulated, each task on its fastest-area size, no knowledge of runtimes) is
from the same bound. Writes ``bench/results/far.md`` and ``far_rho.png``.

Reproduce (5-15 minutes on 2 shared cores; the committed results used 1000 runs)::

    .venv/bin/python bench/far_eval.py --runs 1000
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from migd.core.catalog import geometry
from migd.policysim.engine import PolicySimConfig, simulate
from migd.policysim.far import lower_bound, plan_batch
from migd.policysim.metrics import compute_metrics
from migd.policysim.policies import named_policy
from migd.policysim.progress import ProgressBar
from migd.policysim.workloads import far_jobs, far_tasks

RESULTS = Path(__file__).resolve().parent / "results"
NS = (10, 15, 20, 25, 30, 35)
TABLE4 = {  # [Villarrubia] Table 4: mean rho of 1000 runs, WideTimes, A100
    "poor": (1.23, 1.08, 1.04, 1.03, 1.02, 1.02),
    "mixed": (1.20, 1.08, 1.04, 1.03, 1.02, 1.02),
    "good": (1.21, 1.07, 1.05, 1.03, 1.02, 1.01),
}
NAMES = {"poor": "PoorScaling", "mixed": "MixedScaling", "good": "GoodScaling"}


def strong_bound(times: Sequence[Mapping[int, float]], slices: int) -> float:
    """A tighter bound than the paper's area bound.

    The least T with ``sum_i min{s t_i(s) : t_i(s) <= T} <= slices * T``.

    Every task must finish within the makespan, so it runs on a size no slower than
    T; the cheapest such area, summed, must fit in ``slices * T``.
    """
    lo = max(min(t.values()) for t in times)
    hi = sum(max(t.values()) for t in times)

    def fits(limit: float) -> bool:
        return sum(min(s * v for s, v in t.items() if v <= limit) for t in times) <= slices * limit

    for _ in range(60):
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


def rho_table(
    runs: int, p_sup: float, bar: ProgressBar, variants: Sequence[str] = ("paper", "migd")
) -> dict[tuple[str, str, int], list[float]]:
    geo = geometry("A100-40GB")
    out: dict[tuple[str, str, int], list[float]] = {}
    for scaling in TABLE4:
        for n in NS:
            for seed in range(runs):
                tasks = far_tasks(n, scaling, "wide", seed=seed, p_sup=p_sup)
                pairs = [(t.name, t.times) for t in tasks]
                times = [t.times for t in tasks]
                bound = lower_bound(times, 7)
                for variant in variants:
                    schedule = plan_batch(pairs, geo, variant=variant)  # type: ignore[arg-type]
                    out.setdefault((variant, scaling, n), []).append(schedule.makespan_s / bound)
                if "migd" in variants:
                    out.setdefault(("strong", scaling, n), []).append(
                        strong_bound(times, 7) / bound
                    )
            bar.update(1, f"p_sup={p_sup} {scaling} n={n}")
    return out


def _fit_error(table: dict[tuple[str, str, int], list[float]]) -> float:
    return statistics.mean(
        abs(statistics.mean(table[("paper", scaling, n)]) - target)
        for scaling, targets in TABLE4.items()
        for n, target in zip(NS, targets, strict=True)
    )


def fit_verdict(tables: dict[float, dict[tuple[str, str, int], list[float]]]) -> str:
    """Which p_sup reproduces Table 4 best, in words, from the measured fits."""
    best = min(tables, key=lambda p: _fit_error(tables[p]))
    spread = {
        p: max(statistics.mean(tables[p][("paper", s, n)]) for s in TABLE4 for n in NS[1:2])
        - min(statistics.mean(tables[p][("paper", s, n)]) for s in TABLE4 for n in NS[1:2])
        for p in tables
    }
    return (
        f"FAR as published is closest to Table 4 with p_sup = {best:g} (mean absolute "
        f"difference {_fit_error(tables[best]):.3f} over the 18 cells). The paper also "
        "observes no significant difference between the scaling mixes for the same n; "
        f"at n = 15 the three mixes differ by {spread[best]:.3f} in rho with p_sup = "
        f"{best:g} and by {spread[max(tables)]:.3f} with p_sup = {max(tables):g}. "
        f"p_sup = {best:g} is therefore taken as Table 4's setting (an inference from "
        "these numbers, not a statement of the paper); it is the default of "
        "`far_tasks` and of `python -m migd.policysim far`. Any p_sup > 0 makes at least one "
        "task per size class memory-bound (the generator rounds up)."
    )


def fit_markdown(tables: dict[float, dict[tuple[str, str, int], list[float]]]) -> str:
    """How far FAR as published lands from Table 4 for each p_sup (all 18 cells)."""
    lines = [
        "| p_sup | mean abs. difference | largest difference | cells within ±0.015 |",
        "|---:|---:|---:|---:|",
    ]
    for p_sup, table in sorted(tables.items()):
        diffs = [
            statistics.mean(table[("paper", scaling, n)]) - target
            for scaling, targets in TABLE4.items()
            for n, target in zip(NS, targets, strict=True)
        ]
        worst = max(diffs, key=abs)
        near = sum(abs(d) <= 0.015 for d in diffs)
        lines.append(
            f"| {p_sup:g} | {statistics.mean(abs(d) for d in diffs):.3f} | {worst:+.3f} "
            f"| {near} of {len(diffs)} |"
        )
    return "\n".join(lines) + "\n"


def rho_markdown(table: dict[tuple[str, str, int], list[float]]) -> str:
    head = "| Configuration | Variant | " + " | ".join(f"n={n}" for n in NS) + " |"
    lines = [head, "|---|---|" + "---:|" * len(NS)]
    for scaling, targets in TABLE4.items():
        paper = " | ".join(f"{v:.2f}" for v in targets)
        lines.append(f"| {NAMES[scaling]} | [Villarrubia] Table 4 | {paper} |")
        for variant, label in (("paper", "FAR as published"), ("migd", "FAR + migd extensions")):
            if (variant, scaling, NS[0]) not in table:
                continue
            cells = []
            for n, target in zip(NS, targets, strict=True):
                mean = statistics.mean(table[(variant, scaling, n)])
                mark = "" if mean <= target + 0.005 else " ▲"
                cells.append(f"{mean:.3f}{mark}")
            lines.append(f"| | {label} | " + " | ".join(cells) + " |")
        if ("strong", scaling, NS[0]) in table:
            strong = " | ".join(f"{statistics.mean(table[('strong', scaling, n)]):.3f}" for n in NS)
            lines.append(f"| | stronger bound / area bound | {strong} |")
    return "\n".join(lines) + "\n"


def timing(runs: int) -> str:
    geo = geometry("A100-40GB")
    lines = [
        "| Tasks | Variant | mean | median | p95 | max |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for n in (35, 100):
        for variant in ("paper", "migd"):
            samples = []
            for seed in range(runs):
                pairs = [(t.name, t.times) for t in far_tasks(n, "mixed", "wide", seed=seed)]
                started = time.perf_counter()
                plan_batch(pairs, geo, variant=variant)  # type: ignore[arg-type]
                samples.append(1000 * (time.perf_counter() - started))
            samples.sort()
            p95 = samples[min(len(samples) - 1, int(0.95 * len(samples)))]
            lines.append(
                f"| {n} | {variant} | {statistics.mean(samples):.1f} ms "
                f"| {statistics.median(samples):.1f} ms | {p95:.1f} ms | {samples[-1]:.1f} ms |"
            )
    return "\n".join(lines) + "\n"


def online(runs: int) -> str:
    """migd's online scheduler on the same batches (fastest-area sizes, scheme A)."""
    geo = geometry("A100-40GB")
    lines = [
        "| Configuration (p_sup = 0.5) | FAR + migd extensions | migd online (A) "
        "| migd online (B) |",
        "|---|---:|---:|---:|",
    ]
    for scaling in TABLE4:
        far_r, on_a, on_b = [], [], []
        for seed in range(runs):
            # p_sup = 0.5 as the far-* workloads: with none, every task's fastest-area
            # size is one slice and the online run is trivially all-1g
            tasks = far_tasks(20, scaling, "wide", seed=seed, p_sup=0.5)
            bound = lower_bound([t.times for t in tasks], 7)
            schedule = plan_batch([(t.name, t.times) for t in tasks], geo)
            far_r.append(schedule.makespan_s / bound)
            for queue, sink in (("size", on_a), ("fifo", on_b)):
                from migd.core.queueing import QueuePolicy

                policy = named_policy("migd", QueuePolicy(queue))
                m = compute_metrics(simulate(far_jobs(tasks), policy, PolicySimConfig()))
                sink.append(m.makespan_s / bound)
        lines.append(
            f"| {NAMES[scaling]}, n=20 | {statistics.mean(far_r):.3f} "
            f"| {statistics.mean(on_a):.3f} | {statistics.mean(on_b):.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot(table: dict[tuple[str, str, int], list[float]], path: Path) -> bool:
    try:
        mpl = importlib.import_module("matplotlib")
    except ImportError:
        return False
    mpl.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    fig, axes = plt.subplots(1, 3, figsize=(9, 3), dpi=100, sharey=True)
    for ax, scaling in zip(axes, TABLE4, strict=True):
        ax.plot(NS, TABLE4[scaling], "k--", marker="s", label="[Villarrubia] Table 4")
        for variant, style in (("paper", "o-"), ("migd", "^-")):
            ys = [statistics.mean(table[(variant, scaling, n)]) for n in NS]
            ax.plot(NS, ys, style, label=f"FAR {variant}")
        ax.set_title(NAMES[scaling], fontsize=9)
        ax.set_xlabel("tasks per batch")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("rho (makespan / area bound)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200, help="batches per cell (paper: 1000)")
    parser.add_argument("--timing-runs", type=int, default=100)
    parser.add_argument("--online-runs", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    fit_p = (0.1, 0.25)
    bar = ProgressBar((2 + len(fit_p)) * len(TABLE4) * len(NS), "far_eval", enabled=True)
    zero = rho_table(args.runs, 0.0, bar)
    half = rho_table(args.runs, 0.5, bar)
    fits = {0.0: zero, 0.5: half}
    for p_sup in fit_p:
        fits[p_sup] = rho_table(args.runs, p_sup, bar, variants=("paper",))
    bar.close()
    load_before = os.getloadavg()[0]
    timings = timing(args.timing_runs)
    load_after = os.getloadavg()[0]
    online_table = online(args.online_runs)
    elapsed = time.monotonic() - started
    plotted = plot(zero, args.out / "far_rho.png")
    command = "python bench/far_eval.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n".join(
        [
            "# FAR: makespan against the area lower bound ([Villarrubia] Table 4)",
            "",
            f"Generated by `bench/far_eval.py`; command `{command.strip()}`; {args.runs} "
            f"batches per cell (the paper used 1000); {elapsed:.0f} s on this machine.",
            "",
            "rho = FAR makespan (reconfigurations included, [Villarrubia] Table 1 times) / "
            "(sum of each task's least area / 7), as in [Villarrubia] §6.4; WideTimes "
            "(t(1) ~ U(1, 100) s) on an A100. ▲ = above the paper's value. *FAR as "
            "published*: phases 1-3 of the paper: the allocation family, Algorithm 1 "
            "on each, and Algorithm 2 on the best (moves and swaps between same-size "
            "instances judged on slice end times, climbing to the parent instance where "
            "neither is possible, stopping at the root). *FAR + migd extensions* (the "
            "default of `plan_batch`): a second phase-2 candidate per allocation that "
            "puts tasks, longest first over all sizes, on the instance whose heaviest "
            "root-to-leaf path grows least, and a refinement whose moves (across sizes "
            "too, and off the critical instance's ancestors) and swaps are each timed "
            "exactly and kept only when they shorten the makespan; it keeps the "
            "published result when that is shorter. *Stronger bound*: the least T such "
            "that every task fits in T on its cheapest fast-enough size and the areas fit "
            "in 7T; where it exceeds 1, part of rho is the area bound's slack, not FAR's.",
            "",
            "## Which generator setting Table 4 used",
            "",
            "[Villarrubia] does not state p_sup (the share of memory-bound, super-linear tasks) "
            "for Table 4; Figure 11 illustrates the generator with 0.5. FAR as published "
            "on the generator with several p_sup, against Table 4's 18 cells:",
            "",
            fit_markdown(fits),
            fit_verdict(fits),
            "",
            "## Table 4's setting: p_sup = 0 (no memory-bound tasks)",
            "",
            rho_markdown(zero),
            "## Figure 11's setting: p_sup = 0.5 (harder; not what Table 4 reports)",
            "",
            "Half the tasks of each size class memory-bound: their least area is at "
            "larger sizes, which makes batches harder to pack. No paper number to "
            "compare with; Table 4's values are repeated for scale.",
            "",
            rho_markdown(half),
            "## Planning time (MixedScaling, WideTimes)",
            "",
            f"{args.timing_runs} batches each (p_sup = 0), one core of this "
            f"{os.cpu_count()}-core machine, shared with other work while measured (load "
            f"average {load_before:.1f} before, {load_after:.1f} after). The paper reports "
            "12.32 ms for 100 tasks (C++, Ryzen 5 4600H); the brief's budget is 50 ms.",
            "",
            timings,
            "## migd's online scheduler on FAR's batches",
            "",
            "20-task batches with p_sup = 0.5 (as the `far-*` workloads; with p_sup = 0 "
            "every task's fastest-area size is one slice) submitted at t=0 to the "
            "simulated node, each task asking for its fastest-area size (no runtimes "
            "known to migd), next to FAR's plan of the same batches. Values are makespan "
            "/ area bound, like rho.",
            "",
            online_table,
            "![rho vs n, p_sup = 0 (Table 4's setting)](far_rho.png)"
            if plotted
            else "(matplotlib not installed: no plot)",
            "",
        ]
    )
    (args.out / "far.md").write_text(text)
    print(f"wrote {args.out / 'far.md'} in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
