"""``python -m migd.policysim`` (and ``migctl simulate``): compare policies, plan batches.

Examples::

    python -m migd.policysim compare --workload ht3 --out sim-out
    python -m migd.policysim compare --trace jobs.csv --gpus 4 --policies exclusive,migd
    python -m migd.policysim far --n 20 --scaling mixed --runs 100
    python -m migd.policysim list

``compare`` is the default subcommand. Exit status: 0 on success, 2 on a usage
or input error (the message says what to fix).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from migd.core.catalog import geometry, model_names
from migd.errors import InvalidRequest, MigdError
from migd.policysim.compare import DEFAULT_POLICIES, compare, count_runs
from migd.policysim.engine import PolicySimConfig
from migd.policysim.far import lower_bound, plan_batch
from migd.policysim.jobs import WorkloadJob
from migd.policysim.policies import POLICY_NAMES
from migd.policysim.progress import ProgressBar
from migd.policysim.report import INCOMPLETE, fmt_duration, write_report
from migd.policysim.workloads import (
    SCALING,
    TIMES,
    TRACE_COLUMNS,
    WORKLOADS,
    classic_sizes,
    far_tasks,
    load_trace,
)

SUBCOMMANDS = ("compare", "far", "list")


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Simulate migd's node scheduler against the papers' baselines. "
        "Without a subcommand, the arguments are compare's.",
    )
    sub = parser.add_subparsers(dest="command")

    cmp_ = sub.add_parser("compare", help="run policies on a workload and write a report")
    src = cmp_.add_mutually_exclusive_group()
    src.add_argument("--workload", default="ht3", help="a built-in workload (see `list`)")
    src.add_argument("--trace", type=Path, help="CSV or JSON job trace (see `list`)")
    cmp_.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="comma-separated policies, or 'all' (default: %(default)s)",
    )
    cmp_.add_argument(
        "--queue",
        default="both",
        choices=("both", "size", "fifo"),
        help="queue scheme: size = [MIG-HT] A, fifo = B (default: both)",
    )
    cmp_.add_argument("--model", help="GPU model (default: the workload's, A100-40GB)")
    cmp_.add_argument("--gpus", type=int, help="GPUs per node (default: the workload's)")
    cmp_.add_argument("--nodes", type=int, help="nodes in the pool (default: the workload's)")
    cmp_.add_argument("--profiles", default="classic", help="MIG profile set (default: classic)")
    cmp_.add_argument("--seed", type=int, default=1, help="workload seed (default: 1)")
    cmp_.add_argument(
        "--mps-interference",
        type=float,
        default=0.0,
        help="extra MPS slowdown when clients share a GPU (default: 0)",
    )
    cmp_.add_argument("--out", type=Path, default=Path("sim-out"), help="output directory")
    cmp_.add_argument("--no-plots", action="store_true", help="write only the Markdown")
    cmp_.add_argument("--check", action="store_true", help="assert invariants after every event")
    cmp_.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    far = sub.add_parser("far", help="plan synthetic batches with FAR and report rho")
    far.add_argument("--n", type=int, default=20, help="tasks per batch (default: 20)")
    far.add_argument("--scaling", default="mixed", choices=sorted(SCALING))
    far.add_argument("--times", default="wide", choices=sorted(TIMES))
    far.add_argument("--runs", type=int, default=100, help="batches (default: 100)")
    far.add_argument("--model", default="A100-40GB")
    far.add_argument("--gpus", type=int, default=1, help="GPUs of that model (default: 1)")
    far.add_argument("--seed", type=int, default=1)
    far.add_argument(
        "--p-sup",
        type=float,
        default=0.0,
        help="share of memory-bound (super-linear) tasks; 0 matches [Villarrubia] Table 4, "
        "Figure 11 uses 0.5 (default: %(default)s)",
    )
    far.add_argument(
        "--variant",
        default="migd",
        choices=("migd", "paper"),
        help="paper: FAR as published (Algorithms 1 and 2); migd: with migd's extensions",
    )
    far.add_argument("--show", action="store_true", help="print the steps of the first batch")
    far.add_argument("-q", "--quiet", action="store_true")

    sub.add_parser("list", help="list workloads, policies, models and trace columns")
    return parser


def _cmd_list() -> int:
    print("Workloads:")
    for spec in WORKLOADS.values():
        print(f"  {spec.name:18s} {spec.description}")
    print("\nPolicies:")
    print("  " + ", ".join(POLICY_NAMES))
    print("\nModels:")
    print("  " + ", ".join(model_names()))
    print("\nTrace columns (CSV header or JSON keys):")
    for col, desc in TRACE_COLUMNS.items():
        print(f"  {col:15s} {desc}")
    return 0


def _cmd_compare(args: argparse.Namespace, argv: Sequence[str]) -> int:
    jobs: list[WorkloadJob]
    if args.trace is not None:
        jobs = load_trace(args.trace)
        name, desc, assumptions = args.trace.name, f"trace {args.trace}", "as given in the trace"
        model = geometry(args.model).model if args.model else "A100-40GB"
        gpus, nodes = 1, 1
    else:
        spec = WORKLOADS.get(args.workload)
        if spec is None:
            raise MigdError(
                f"unknown workload {args.workload!r}", hint="workloads: " + ", ".join(WORKLOADS)
            )
        model = geometry(args.model).model if args.model else spec.model
        jobs = spec.build(args.seed, model)
        name, desc, assumptions = spec.name, spec.description, spec.assumptions
        gpus, nodes = spec.gpus, spec.nodes
        if model != spec.model:
            desc += f" (rebuilt for {model})"
    config = PolicySimConfig(
        model=model,
        gpus=args.gpus or gpus,
        nodes=args.nodes or nodes,
        profiles=args.profiles,
        mps_interference=args.mps_interference,
        check_invariants=args.check,
    )
    policies = (
        list(POLICY_NAMES)
        if args.policies == "all"
        else [p.strip() for p in args.policies.split(",") if p.strip()]
    )
    if any(j.growth is not None for j in jobs) and "migd+forecast" not in policies:
        policies.append("migd+forecast")
    total = count_runs(policies, args.queue, config.model)
    bar = ProgressBar(total, f"simulating {name}", enabled=False if args.quiet else None)
    started = time.monotonic()
    comparison = compare(
        jobs,
        workload=name,
        description=desc,
        assumptions=assumptions,
        policies=policies,
        queue=args.queue,
        config=config,
        on_progress=lambda policy: bar.update(1, policy),
        on_step=lambda policy, fraction: bar.partial(fraction, policy),
    )
    bar.close()
    command = "python -m migd.policysim " + " ".join(shlex.quote(a) for a in argv)
    path = write_report(comparison, args.out, plots=not args.no_plots, command=command)
    print(f"{name}: {len(jobs)} jobs, {total} runs in {time.monotonic() - started:.1f}s")
    print(f"  throughput ratios are vs {comparison.baseline}")
    for row in comparison.rows:
        m = row.metrics
        ratio = comparison.ratio(row.label)
        mark = "  " if m.complete else f" {INCOMPLETE}"
        print(
            f"  {row.label:22s} done {m.completed:4d}/{m.jobs:<4d} "
            f"throughput {m.throughput_per_h:8.1f}/h ({ratio:4.2f}x){mark} "
            f"makespan {fmt_duration(m.makespan_s):>8s}  util {100 * m.compute_util:3.0f} %"
        )
    if any(not r.metrics.complete for r in comparison.rows):
        print(
            f"  {INCOMPLETE} did not complete every job: its throughput counts only the jobs "
            "it ran and is not comparable"
        )
    print(f"report: {path}")
    return 0


def _cmd_far(args: argparse.Namespace) -> int:
    geo = geometry(args.model)
    if not 1 <= args.gpus <= 8:
        raise InvalidRequest(
            f"--gpus must be 1-8, got {args.gpus}", hint="FAR plans one node of 1-8 GPUs"
        )
    if args.n < 1 or args.runs < 1:
        raise InvalidRequest("--n and --runs must be at least 1")
    if not 0.0 <= args.p_sup <= 1.0:
        raise InvalidRequest(f"--p-sup must be in [0, 1], got {args.p_sup}")
    sizes = classic_sizes(geo)
    rhos: list[float] = []
    times_ms: list[float] = []
    bar = ProgressBar(args.runs, "planning", enabled=False if args.quiet else None)
    for run in range(args.runs):
        tasks = far_tasks(
            args.n, args.scaling, args.times, seed=args.seed + run, p_sup=args.p_sup, sizes=sizes
        )
        started = time.perf_counter()
        schedule = plan_batch(
            [(t.name, t.times) for t in tasks], geo, gpus=args.gpus, variant=args.variant
        )
        times_ms.append(1000 * (time.perf_counter() - started))
        slices = geo.compute_slices * args.gpus
        rhos.append(schedule.makespan_s / lower_bound([t.times for t in tasks], slices))
        if args.show and run == 0:
            for step in schedule.steps():
                what = step.task or step.kind
                print(
                    f"{step.time_s:9.2f}s {step.end_s:9.2f}s  {step.kind:7s} "
                    f"GPU{step.gpu} {step.profile}@{step.start}  {what}"
                )
        bar.update(1)
    bar.close()
    print(
        f"FAR ({args.variant}) on {args.gpus} x {geo.model}, {args.scaling} scaling, "
        f"{args.times} times, p_sup={args.p_sup:g}, n={args.n}, {args.runs} batches: "
        f"rho mean {statistics.mean(rhos):.3f} "
        f"(max {max(rhos):.3f}); planning {statistics.mean(times_ms):.1f} ms mean, "
        f"{max(times_ms):.1f} ms max"
    )
    return 0


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m migd.policysim") -> int:
    """Entry point of ``python -m migd.policysim`` and ``migctl simulate`` (``prog`` names which,
    for the usage lines); returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    # compare is the default subcommand. argparse has no default subparser, and compare's
    # options take values that a subcommand positional would mistake for a command name, so
    # the rule is stated on the first argument: a subcommand or a help flag, else compare.
    if not args_list or args_list[0] not in (*SUBCOMMANDS, "-h", "--help"):
        args_list.insert(0, "compare")
    parser = _parser(prog)
    args = parser.parse_args(args_list)
    try:
        if args.command == "list":
            return _cmd_list()
        if args.command == "far":
            return _cmd_far(args)
        return _cmd_compare(args, args_list)
    except MigdError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return 2
