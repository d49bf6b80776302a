"""Evaluate migd's memory forecast on synthetic traces shaped like [MIG-HT]'s four cases.

[MIG-HT] (§5.2.2) reports, for four dynamic-memory workloads on an A100-40GB:

=====================  ===========  ==========  ==============================
workload               OOM at iter  fired at    estimate at 10% vs actual peak
=====================  ===========  ==========  ==============================
Qwen2-7B inference     94 (10 GB)   6           11.41 GB vs 12.23 GB
Llama-3 inference      72           6           16.64 GB vs 16.63 GB
FLAN-T5 training       41           31          (mean error over all four:
FLAN-T5 inference      27           21           14.98%)
=====================  ===========  ==========  ==============================

The recorded traces are not published, so this script *generates* traces from
what the paper states and from stated assumptions for what it does not (see
``CASES`` and the results file): memory at iteration ``t`` (1-based) is

    y(t) = y0 + A · [(1 - κ)·u + κ·u²],   u = (t - 1) / (N - 1)

(allocated + CUDA context, the series that causes OOM), with ``A`` and ``N``
solved so that the noiseless trace crosses the partition between iterations
``oom - 1`` and ``oom`` and, where the paper gives it, ends at the stated peak.
Per-iteration noise is Gaussian, ``σ = noise_abs + noise_rel · growth``; NVML's
``used`` is the allocator's *reserved* memory + context, where reserved ratchets
up over allocated (fragmentation 5-15%, 20 MiB segments) and drops back every 20
iterations (an ``empty_cache()``-style sawtooth).

For [MIG-HT]'s own method (the memory *requested* from the caching allocator per
iteration and the inverse reuse ratio ``q = requested / physical``, each fitted
linearly, combined as ``requested / q``) the traces also carry allocator request
statistics: ``q`` grows linearly from ``Q_START`` to ``Q_END`` over the run (the
paper observes the reuse ratio falling over time; the values are assumptions) with
``Q_NOISE`` relative noise, and ``requested = physical · q``, so the physical memory
and the OOM iteration are the same as for the allocated series.

For each case and seed the forecaster sees one sample per iteration, with the
total iteration count as the horizon, and the script records the first iteration
at which it fires, the estimate after 10% of the run, and (control) whether it
ever fires when the same job runs on the next larger partition, where it fits.

Run ``python bench/forecast_eval.py`` (prints Markdown), or with ``--out
bench/results/forecast.md`` to rewrite the generated part of the results file
(below its marker line; the discussion above it is kept). Deterministic: every
trace is seeded from ``--seed`` and the case/replicate index.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from migd.core.catalog import geometry
from migd.core.forecast import Forecaster, ForecastPolicy

GIB = 1024.0
A100 = geometry("A100-40GB")
PROFILE_MIB = {p.name: p.memory_mib for p in A100.profiles}
CONTEXT_MIB = 480.0  # CUDA context + cuBLAS/cuDNN handles under PyTorch 2.x (assumption)
# Inverse reuse ratio q = requested / physical per iteration (assumptions, see the docstring).
Q_START, Q_END, Q_NOISE = 1.3, 2.0, 0.02


@dataclass(frozen=True)
class Case:
    name: str
    paper_oom: int
    paper_fire: int
    partition: str  # the profile the job starts on
    control: str  # the next larger profile, where it fits
    y0_mib: float  # allocated + context at iteration 1
    kappa: float  # share of the growth that is quadratic in the iteration
    noise_abs_mib: float
    noise_rel: float  # extra noise, fraction of the growth so far
    peak_mib: float | None = None  # paper's stated final peak (solves N)
    n_iters: int | None = None  # assumed run length where the paper gives no peak
    paper_estimate_gib: float | None = None
    paper_peak_gib: float | None = None
    why: str = ""
    knee: float = 0.0  # fraction of the run with no growth before it starts

    def growth(self, u: float) -> float:
        """Normalised growth, 0 at the first iteration and 1 at the last."""
        v = max(0.0, (u - self.knee) / (1.0 - self.knee))
        return (1 - self.kappa) * v + self.kappa * v * v


CASES: tuple[Case, ...] = (
    Case(
        "Qwen2-7B inference",
        paper_oom=94,
        paper_fire=6,
        partition="2g.10gb",
        control="3g.20gb",
        y0_mib=5.6 * GIB,
        kappa=0.2,
        noise_abs_mib=16.0,
        noise_rel=0.0,
        peak_mib=12.23 * GIB,
        paper_estimate_gib=11.41,
        paper_peak_gib=12.23,
        why="4-bit weights ≈ 5.1 GiB + context; KV cache linear in context, mild convexity",
    ),
    Case(
        "Llama-3 (3B) inference",
        paper_oom=72,
        paper_fire=6,
        partition="2g.10gb",
        control="3g.20gb",
        y0_mib=6.5 * GIB,
        kappa=0.0,
        noise_abs_mib=16.0,
        noise_rel=0.0,
        peak_mib=16.63 * GIB,
        paper_estimate_gib=16.64,
        paper_peak_gib=16.63,
        why="fp16 weights 6.0 GiB + context; SDPA attention, KV cache linear",
    ),
    Case(
        "FLAN-T5 training",
        paper_oom=41,
        paper_fire=31,
        partition="1g.5gb",
        control="2g.10gb",
        y0_mib=2.0 * GIB,
        kappa=0.6,
        noise_abs_mib=32.0,
        noise_rel=0.05,
        n_iters=60,
        why="small model + Adam state; eager T5 attention (L² scores), padded batches",
    ),
    Case(
        "FLAN-T5 inference",
        paper_oom=27,
        paper_fire=21,
        partition="1g.5gb",
        control="2g.10gb",
        y0_mib=1.5 * GIB,
        kappa=0.6,
        noise_abs_mib=24.0,
        noise_rel=0.03,
        n_iters=40,
        why="fp32 base model + context; eager T5 attention (L² scores)",
    ),
)


@dataclass(frozen=True)
class Shape:
    n_iters: int
    amplitude_mib: float

    def mean(self, case: Case, t: int) -> float:
        return case.y0_mib + self.amplitude_mib * case.growth((t - 1) / (self.n_iters - 1))


def solve_shape(case: Case) -> Shape:
    """``N`` and ``A`` so the noiseless trace crosses the limit at ``paper_oom - 0.5``."""
    limit = PROFILE_MIB[case.partition]
    t_cross = case.paper_oom - 0.5
    if case.peak_mib is not None:
        target = (limit - case.y0_mib) / (case.peak_mib - case.y0_mib)
        lo, hi = 0.0, 1.0  # growth() is increasing: bisect for growth(u) = target
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if case.growth(mid) < target else (lo, mid)
        n_iters = round(1 + (t_cross - 1) / hi)
    else:
        assert case.n_iters is not None
        n_iters = case.n_iters
    amplitude = (limit - case.y0_mib) / case.growth((t_cross - 1) / (n_iters - 1))
    return Shape(n_iters, amplitude)


@dataclass(frozen=True)
class Trace:
    allocated_ctx: list[float]  # allocated + context per iteration (index 0 = iteration 1)
    used: list[float]  # NVML: reserved + context, on an unconstrained GPU
    n_iters: int
    requested: list[float]  # memory requested from the caching allocator per iteration
    reuse_ratio: list[float]  # physical / requested ([MIG-HT]'s reuse ratio)


def make_trace(
    case: Case, shape: Shape, seed: int, noise_scale: float, q_end: float = Q_END
) -> Trace:
    rng = random.Random(seed)
    rng_q = random.Random(seed + 7_919_000)  # its own stream: the other series stay as they were
    allocated_ctx: list[float] = []
    used: list[float] = []
    requested: list[float] = []
    ratios: list[float] = []
    reserved = 0.0
    for t in range(1, shape.n_iters + 1):
        mean = shape.mean(case, t)
        sigma = noise_scale * (case.noise_abs_mib + case.noise_rel * (mean - case.y0_mib))
        # Per-iteration peaks never fall below the weights: clip the noise at -3σ.
        value = mean + max(-3 * sigma, rng.gauss(0.0, sigma)) if sigma > 0 else mean
        allocated_ctx.append(value)
        allocated = value - CONTEXT_MIB
        wanted = math.ceil(allocated * rng.uniform(1.05, 1.15) / 20.0) * 20.0
        reserved = wanted if t % 20 == 0 else max(reserved, wanted)
        used.append(reserved + CONTEXT_MIB)
        u = (t - 1) / (shape.n_iters - 1)
        q = (Q_START + (q_end - Q_START) * u) * (1.0 + rng_q.gauss(0.0, noise_scale * Q_NOISE))
        requested.append(allocated * q)
        ratios.append(1.0 / q)
    return Trace(allocated_ctx, used, shape.n_iters, requested, ratios)


def oom_iteration(trace: Trace, limit_mib: float) -> int | None:
    for i, value in enumerate(trace.allocated_ctx, start=1):
        if value > limit_mib:
            return i
    return None


def _feed(fc: Forecaster, trace: Trace, i: int, series: str) -> None:
    """Sample of iteration ``i`` (1-based), as the wrapper would report it."""
    alloc_ctx = trace.allocated_ctx[i - 1]
    used = trace.used[i - 1]
    if series == "used":
        fc.add(i, used_mib=used)
    elif series == "reuse":  # what a job reports for [MIG-HT]'s method: no allocated figure
        fc.add(
            i,
            used_mib=used,
            reserved_mib=used - CONTEXT_MIB,
            requested_mib=trace.requested[i - 1],
            reuse_ratio=trace.reuse_ratio[i - 1],
        )
    else:
        fc.add(
            i,
            used_mib=used,
            allocated_mib=alloc_ctx - CONTEXT_MIB,
            reserved_mib=used - CONTEXT_MIB,
        )


def first_fire(
    trace: Trace, policy: ForecastPolicy, limit_mib: float, series: str, stop: int | None
) -> int | None:
    """First iteration at which the forecast fires, among iterations before ``stop``."""
    fc = Forecaster(policy)
    last = trace.n_iters if stop is None else min(trace.n_iters, stop - 1)
    for i in range(1, last + 1):
        _feed(fc, trace, i, series)
        if fc.verdict(limit_mib, horizon=trace.n_iters).fire:
            return i
    return None


def control_fire(
    trace: Trace, policy: ForecastPolicy, limit_mib: float, series: str
) -> bool | None:
    """Whether the forecast ever fires on a partition the job fits in; ``None`` if it
    does not fit (its allocated + context peak passes the policy's threshold)."""
    if max(trace.allocated_ctx) > limit_mib - policy.margin_mib(limit_mib):
        return None
    return first_fire(trace, policy, limit_mib, series, None) is not None


def fp_text(results: Sequence[bool | None]) -> str:
    runs = [r for r in results if r is not None]
    text = f"{sum(runs)}/{len(runs)}"
    if len(runs) < len(results):
        text += f" ({len(results) - len(runs)} do not fit)"
    return text


def estimate_at(
    trace: Trace, policy: ForecastPolicy, series: str, fraction: float
) -> tuple[int, float, float]:
    """(iteration, point, upper) forecast of the peak after ``fraction`` of the run."""
    upto = max(3, math.ceil(fraction * trace.n_iters))
    fc = Forecaster(replace(policy, min_samples=3))
    for i in range(1, upto + 1):
        _feed(fc, trace, i, series)
    fc_result = fc.forecast(horizon=trace.n_iters)
    return upto, fc_result.predicted_peak_mib, fc_result.upper_mib


# -- experiment grid --------------------------------------------------------------------------

POLICIES: dict[str, ForecastPolicy] = {
    "default (t, one-sided 99%, leverage)": ForecastPolicy(),
    "z=2.326, leverage": ForecastPolicy(student_t=False),
    "z=2.576 (two-sided), leverage": ForecastPolicy(student_t=False, one_sided=False),
    "paper: z=2.576·σ, no leverage": ForecastPolicy(z=2.576, leverage=False),
    "default, no convergence gate": ForecastPolicy(convergence_window=1),
}


def summarise(values: Sequence[int | None]) -> str:
    hits = [v for v in values if v is not None]
    if not hits:
        return "never"
    text = f"{statistics.median(hits):g} [{min(hits)}–{max(hits)}]"
    if len(hits) < len(values):
        text += f" ({len(values) - len(hits)}× never)"
    return text


def pct(a: float, b: float) -> float:
    return 100.0 * (a - b) / b


Out = Callable[[str], None]
DEFAULT = ForecastPolicy()


def trace_seed(seed: int, case_index: int, rep: int) -> int:
    return seed * 10_000 + case_index * 1000 + rep


def traces_table(shapes: dict[str, Shape], out: Out) -> None:
    out("## Traces (synthetic; what is taken from the paper and what is assumed)\n")
    out(
        "| case | partition (MiB) | N iters | y(1) GiB | peak GiB | κ (quadratic share) "
        "| noise σ | noiseless OOM iter | assumptions |"
    )
    out("|---|---|---|---|---|---|---|---|---|")
    for c in CASES:
        shape = shapes[c.name]
        mean = [shape.mean(c, t) for t in range(1, shape.n_iters + 1)]
        limit = PROFILE_MIB[c.partition]
        oom = next(i for i, v in enumerate(mean, start=1) if v > limit)
        noise = f"{c.noise_abs_mib:g} MiB" + (f" + {c.noise_rel:.0%}·growth" if c.noise_rel else "")
        peak_src = "paper" if c.peak_mib else f"from assumed N={c.n_iters}"
        out(
            f"| {c.name} | {c.partition} ({limit}) | {shape.n_iters} | {c.y0_mib / GIB:.2f} "
            f"| {max(mean) / GIB:.2f} ({peak_src}) | {c.kappa:g} | {noise} | {oom} "
            f"(paper {c.paper_oom}) | {c.why} |"
        )


@dataclass(frozen=True)
class CaseRuns:
    """One case of the main grid (noise ×1): each seed's trace, the iteration at which it
    OOMs on the small partition, and where the default policy first fires on its
    allocated series (shared by the main table and the paper's-method table)."""

    traces: list[Trace]
    ooms: list[int | None]
    fires_alloc: list[int | None]


def case_runs(shapes: dict[str, Shape], seed: int, reps: int) -> list[CaseRuns]:
    """The :class:`CaseRuns` of every case in :data:`CASES`, in order."""
    runs = []
    for ci, c in enumerate(CASES):
        limit = PROFILE_MIB[c.partition]
        traces = [
            make_trace(c, shapes[c.name], trace_seed(seed, ci, rep), 1.0) for rep in range(reps)
        ]
        ooms = [oom_iteration(trace, limit) for trace in traces]
        fires = [
            first_fire(trace, DEFAULT, limit, "allocated", oom)
            for trace, oom in zip(traces, ooms, strict=True)
        ]
        runs.append(CaseRuns(traces, ooms, fires))
    return runs


def main_table(runs: list[CaseRuns], reps: int, out: Out) -> None:
    out(f"\n## Main result: default policy, {reps} seeds per case\n")
    out(
        "Fire/OOM iterations are medians [min–max] over seeds (1-based). *Estimate at 10%*: "
        "the forecast of the run's peak after ⌈10%⌉ of the iterations (at least 3 samples), "
        "point and upper band, vs the trace's actual peak (signed error, mean over seeds). "
        "*Control*: the same traces on the next larger partition: of the runs whose peak stays "
        "under that partition's threshold (limit − margin), those in which the forecast ever "
        "fired (false restarts).\n"
    )
    out(
        "| case | OOM iter (paper) | fires at, allocated series (paper) | fires at, NVML used "
        "only | est. at 10%: iter | point err | upper err | paper est. err | control "
        "false fires (alloc / used) |"
    )
    out("|---|---|---|---|---|---|---|---|---|")
    abs_point: list[float] = []
    abs_upper: list[float] = []
    for c, case in zip(CASES, runs, strict=True):
        limit = PROFILE_MIB[c.partition]
        control = PROFILE_MIB[c.control]
        fires_used: list[int | None] = []
        errs_point: list[float] = []
        errs_upper: list[float] = []
        false_alloc: list[bool | None] = []
        false_used: list[bool | None] = []
        upto = 0
        for trace, oom in zip(case.traces, case.ooms, strict=True):
            fires_used.append(first_fire(trace, DEFAULT, limit, "used", oom))
            peak = max(trace.allocated_ctx)
            upto, point, upper = estimate_at(trace, DEFAULT, "allocated", 0.10)
            errs_point.append(pct(point, peak))
            errs_upper.append(pct(upper, peak))
            false_alloc.append(control_fire(trace, DEFAULT, control, "allocated"))
            false_used.append(control_fire(trace, DEFAULT, control, "used"))
        abs_point.append(statistics.fmean(abs(e) for e in errs_point))
        abs_upper.append(statistics.fmean(abs(e) for e in errs_upper))
        paper_err = (
            f"{pct(c.paper_estimate_gib, c.paper_peak_gib):+.1f}%"
            if c.paper_estimate_gib and c.paper_peak_gib
            else "n/a"
        )
        out(
            f"| {c.name} | {summarise(case.ooms)} ({c.paper_oom}) | {summarise(case.fires_alloc)} "
            f"({c.paper_fire}) | {summarise(fires_used)} | {upto} "
            f"| {statistics.fmean(errs_point):+.1f}% | {statistics.fmean(errs_upper):+.1f}% "
            f"| {paper_err} | {fp_text(false_alloc)} / {fp_text(false_used)} |"
        )
    out(
        f"\nMean |error| of the estimate at 10% over the four cases: point "
        f"**{statistics.fmean(abs_point):.2f}%**, "
        f"upper band **{statistics.fmean(abs_upper):.2f}%** "
        "(paper: 14.98%, estimate definition not fully specified; its formula is ŷ + z·σ).\n"
    )


def band_table(shapes: dict[str, Shape], seed: int, reps: int, out: Out) -> None:
    out(f"\n## Sensitivity: band choice × noise ({reps} seeds)\n")
    out(
        "First fire iteration on the small partition (median [min–max]), and false fires on "
        "the control partition, allocated series. Noise × multiplies σ of every case.\n"
    )
    noise_levels = (0.0, 1.0, 2.0, 4.0)
    out("| policy | case | " + " | ".join(f"noise ×{n:g}" for n in noise_levels) + " |")
    out("|---|---|" + "---|" * len(noise_levels))
    for label, policy in POLICIES.items():
        for ci, c in enumerate(CASES):
            shape = shapes[c.name]
            limit = PROFILE_MIB[c.partition]
            control = PROFILE_MIB[c.control]
            cells = []
            for noise in noise_levels:
                fires: list[int | None] = []
                false: list[bool | None] = []
                for rep in range(reps if noise > 0 else 1):
                    trace = make_trace(c, shape, trace_seed(seed, ci, rep), noise)
                    oom = oom_iteration(trace, limit)
                    fires.append(first_fire(trace, policy, limit, "allocated", oom))
                    false.append(control_fire(trace, policy, control, "allocated"))
                cells.append(f"{summarise(fires)}; FP {fp_text(false)}")
            out(f"| {label} | {c.name} | " + " | ".join(cells) + " |")


def gate_table(shapes: dict[str, Shape], seed: int, reps: int, out: Out) -> None:
    out(f"\n## Sensitivity: convergence gate ({reps} seeds per case, all four cases)\n")
    out(
        "Window = how many of the last fits must agree (1: no gate), tolerance = relative "
        "agreement. False restarts on the control partitions (of the runs that fit) and "
        "median first fire per case.\n"
    )
    names = " | ".join(c.name for c in CASES)
    out(f"| window | tolerance | noise | false restarts | {names} |")
    out("|---|---|---|---|" + "---|" * len(CASES))
    for window, tolerance in ((1, 0.05), (3, 0.05), (3, 0.03), (4, 0.05), (4, 0.03), (5, 0.03)):
        policy = ForecastPolicy(convergence_window=window, convergence_rel_tol=tolerance)
        for noise in (1.0, 2.0):
            false: list[bool | None] = []
            medians = []
            for ci, c in enumerate(CASES):
                shape = shapes[c.name]
                limit = PROFILE_MIB[c.partition]
                fires: list[int | None] = []
                for rep in range(reps):
                    trace = make_trace(c, shape, trace_seed(seed, ci, rep), noise)
                    oom = oom_iteration(trace, limit)
                    fires.append(first_fire(trace, policy, limit, "allocated", oom))
                    false.append(control_fire(trace, policy, PROFILE_MIB[c.control], "allocated"))
                medians.append(summarise(fires))
            mark = " (default)" if policy == DEFAULT else ""
            out(
                f"| {window}{mark} | {tolerance:.0%} | ×{noise:g} | {fp_text(false)} | "
                + " | ".join(medians)
                + " |"
            )


def shape_table(seed: int, reps: int, out: Out) -> None:
    out(f"\n## Sensitivity: growth shape (noise ×1, {reps} seeds, default policy)\n")
    out(
        "The paper does not say how memory grows. Same OOM iteration and (where stated) "
        "peak, different shapes: linear (κ=0), the shape used above, purely quadratic "
        "(κ=1), and a *knee*: no growth for the first 30% / 50% of the run. *Control headroom*: "
        "median of (control threshold − actual peak); negative means the job does not fit "
        "the control partition either, so a fire there is right.\n"
    )
    out(
        "| case | shape | N | OOM iter | fires at | est. at 10%: point err | upper err "
        "| control headroom | control false fires |"
    )
    out("|---|---|---|---|---|---|---|---|---|")
    for ci, base in enumerate(CASES):
        variants = {
            "linear (κ=0)": replace(base, kappa=0.0),
            f"as above (κ={base.kappa:g})": base,
            "quadratic (κ=1)": replace(base, kappa=1.0),
            f"knee 30%, κ={base.kappa:g}": replace(base, knee=0.3),
            "knee 50%, linear": replace(base, knee=0.5, kappa=0.0),
        }
        for label, c in variants.items():
            shape = solve_shape(c)
            limit = PROFILE_MIB[c.partition]
            control = PROFILE_MIB[c.control]
            ooms: list[int | None] = []
            fires: list[int | None] = []
            errs_point: list[float] = []
            errs_upper: list[float] = []
            headroom: list[float] = []
            false: list[bool | None] = []
            for rep in range(reps):
                trace = make_trace(c, shape, trace_seed(seed, ci, rep), 1.0)
                oom = oom_iteration(trace, limit)
                ooms.append(oom)
                fires.append(first_fire(trace, DEFAULT, limit, "allocated", oom))
                _, point, upper = estimate_at(trace, DEFAULT, "allocated", 0.10)
                peak = max(trace.allocated_ctx)
                errs_point.append(pct(point, peak))
                errs_upper.append(pct(upper, peak))
                false.append(control_fire(trace, DEFAULT, control, "allocated"))
                headroom.append(control - DEFAULT.margin_mib(control) - peak)
            out(
                f"| {c.name} | {label} | {shape.n_iters} | {summarise(ooms)} "
                f"| {summarise(fires)} | {statistics.fmean(errs_point):+.1f}% "
                f"| {statistics.fmean(errs_upper):+.1f}% "
                f"| {statistics.median(headroom):+.0f} MiB | {fp_text(false)} |"
            )


PAPER_BAND = replace(DEFAULT, z=2.576, leverage=False)  # ŷ + z·σ as the paper writes it


def paper_method_table(runs: list[CaseRuns], reps: int, out: Out) -> None:
    out(f"\n## [MIG-HT]'s own method: requested memory and inverse reuse ratio ({reps} seeds)\n")
    out(
        "The same traces, but the forecaster sees only what the paper's method uses: the "
        "memory requested from the caching allocator per iteration and the reuse ratio "
        f"(inverse ratio q from {Q_START:g} to {Q_END:g}, ±{Q_NOISE:.0%}; assumptions), "
        "each fitted linearly and combined as requested / q + context. *Upper, paper's "
        "band*: ŷ + 2.576·σ without the leverage term, as the paper writes it. Estimate "
        "errors are signed means over seeds, against the trace's actual peak.\n"
    )
    out(
        "| case | OOM iter | fires at: reuse (paper's method) | allocated (above) | paper "
        "| est. at 10%: iter | point err | upper err, our band | upper err, paper's band "
        "| paper est. err | control false fires (reuse) |"
    )
    out("|---|---|---|---|---|---|---|---|---|---|---|")
    reuse = replace(DEFAULT, series="reuse")
    paper = replace(PAPER_BAND, series="reuse")
    sums: dict[str, list[float]] = {"point": [], "upper": [], "paper": []}
    for c, case in zip(CASES, runs, strict=True):
        limit = PROFILE_MIB[c.partition]
        fires: list[int | None] = []
        errs: dict[str, list[float]] = {"point": [], "upper": [], "paper": []}
        false: list[bool | None] = []
        upto = 0
        for trace, oom in zip(case.traces, case.ooms, strict=True):
            fires.append(first_fire(trace, reuse, limit, "reuse", oom))
            peak = max(trace.allocated_ctx)
            upto, point, upper = estimate_at(trace, reuse, "reuse", 0.10)
            _, _, upper_paper = estimate_at(trace, paper, "reuse", 0.10)
            errs["point"].append(pct(point, peak))
            errs["upper"].append(pct(upper, peak))
            errs["paper"].append(pct(upper_paper, peak))
            false.append(control_fire(trace, reuse, PROFILE_MIB[c.control], "reuse"))
        for key, values in errs.items():
            sums[key].append(statistics.fmean(abs(e) for e in values))
        paper_err = (
            f"{pct(c.paper_estimate_gib, c.paper_peak_gib):+.1f}%"
            if c.paper_estimate_gib and c.paper_peak_gib
            else "n/a"
        )
        out(
            f"| {c.name} | {summarise(case.ooms)} | {summarise(fires)} "
            f"| {summarise(case.fires_alloc)} "
            f"| {c.paper_fire} | {upto} | {statistics.fmean(errs['point']):+.1f}% "
            f"| {statistics.fmean(errs['upper']):+.1f}% | {statistics.fmean(errs['paper']):+.1f}% "
            f"| {paper_err} | {fp_text(false)} |"
        )
    out(
        "\nMean |error| of the estimate at 10% with the paper's method: point "
        f"**{statistics.fmean(sums['point']):.2f}%**, upper band "
        f"**{statistics.fmean(sums['upper']):.2f}%**, the paper's band "
        f"**{statistics.fmean(sums['paper']):.2f}%** (paper: 14.98%).\n"
    )


def reuse_shape_table(shapes: dict[str, Shape], seed: int, reps: int, out: Out) -> None:
    out(f"\n## Sensitivity: how the reuse ratio changes ({reps} seeds, paper's method)\n")
    out(
        "The paper's method fits the requested memory and the inverse reuse ratio q with a "
        "line each. How much q changes over the run is not published: constant q makes "
        "requested memory a fixed multiple of physical memory (the method then sees the "
        "allocated series' shape); a q that grows makes requested memory grow faster than "
        "physical memory, and the ratio of two lines bends. First fire (median) per case and "
        "mean |error| of the estimate at 10% over the four cases.\n"
    )
    names = " | ".join(c.name for c in CASES)
    out(f"| q over the run | {names} | point | upper, our band | upper, paper's band |")
    out("|---|" + "---|" * len(CASES) + "---|---|---|")
    reuse = replace(DEFAULT, series="reuse")
    paper = replace(PAPER_BAND, series="reuse")
    for q_end in (Q_START, Q_END, 3.0):
        medians = []
        errs: dict[str, list[float]] = {"point": [], "upper": [], "paper": []}
        for ci, c in enumerate(CASES):
            shape = shapes[c.name]
            limit = PROFILE_MIB[c.partition]
            fires: list[int | None] = []
            case_errs: dict[str, list[float]] = {"point": [], "upper": [], "paper": []}
            for rep in range(reps):
                trace = make_trace(c, shape, trace_seed(seed, ci, rep), 1.0, q_end=q_end)
                fires.append(first_fire(trace, reuse, limit, "reuse", oom_iteration(trace, limit)))
                peak = max(trace.allocated_ctx)
                _, point, upper = estimate_at(trace, reuse, "reuse", 0.10)
                _, _, upper_paper = estimate_at(trace, paper, "reuse", 0.10)
                case_errs["point"].append(abs(pct(point, peak)))
                case_errs["upper"].append(abs(pct(upper, peak)))
                case_errs["paper"].append(abs(pct(upper_paper, peak)))
            medians.append(summarise(fires))
            for key, values in case_errs.items():
                errs[key].append(statistics.fmean(values))
        label = f"{Q_START:g} → {q_end:g}" + (" (constant)" if q_end == Q_START else "")
        label += " (above)" if q_end == Q_END else ""
        out(
            f"| {label} | "
            + " | ".join(medians)
            + f" | {statistics.fmean(errs['point']):.1f}% | {statistics.fmean(errs['upper']):.1f}% "
            f"| {statistics.fmean(errs['paper']):.1f}% |"
        )


def run(seed: int, reps: int, out: Out) -> None:
    started = time.perf_counter()
    shapes = {c.name: solve_shape(c) for c in CASES}
    sensitivity_reps = max(3, reps // 2)
    traces_table(shapes, out)
    runs = case_runs(shapes, seed, reps)
    main_table(runs, reps, out)
    paper_method_table(runs, reps, out)
    reuse_shape_table(shapes, seed, sensitivity_reps, out)
    band_table(shapes, seed, sensitivity_reps, out)
    gate_table(shapes, seed, reps, out)
    shape_table(seed, sensitivity_reps, out)
    print(f"computed in {time.perf_counter() - started:.1f} s", file=sys.stderr)


MARKER = "<!-- generated below by bench/forecast_eval.py: do not edit by hand -->"


def write_results(path: Path, generated: list[str], command: str) -> None:
    """Replace what follows :data:`MARKER` in ``path``, keeping the hand-written part above."""
    head = ""
    if path.exists():
        text = path.read_text(encoding="utf-8")
        if MARKER in text:
            head = text.split(MARKER, 1)[0]
    body = [MARKER, "", f"Command: `{command}`", "", *generated]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + "\n".join(body) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=2, help="base seed (default 2)")
    parser.add_argument("--reps", type=int, default=20, help="seeds per case (default 20)")
    parser.add_argument("--out", type=Path, help="also write the Markdown to this file")
    args = parser.parse_args(argv)
    lines: list[str] = []

    def out(line: str) -> None:
        lines.append(line)
        print(line)

    run(args.seed, args.reps, out)
    if args.out:
        command = "python bench/forecast_eval.py"
        if args.seed != 2 or args.reps != 20:
            command += f" --seed {args.seed} --reps {args.reps}"
        write_results(args.out, lines, command + f" --out {args.out.as_posix()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
