"""Pool-scale simulation: CPU time, wall time and peak memory for 10, 100 and 1,000 nodes.

    .venv/bin/python bench/pool_scale.py --runs 3      # bench/results/pool_scale.md

Each size simulates a day of :func:`migd.policysim.workloads.pool_stream` (8 A100-40GB per
node, 12 jobs per GPU per day, offered load 0.7) under one policy, in a fresh Python
process per run so that its peak resident memory (``ru_maxrss``) is its own. The
median of ``--runs`` runs is reported with the machine's load average, because the
machine this was written on is shared: its CPU time (``sim CPU``: the simulation's
``time.process_time``) is the figure to compare, as wall time there depends on what else
runs. ``--machine`` names the machine in the results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

CHILD = """
import json, os, resource, sys, time
from migd.policysim.engine import PolicySimConfig, simulate
from migd.policysim.metrics import compute_metrics
from migd.policysim.policies import named_policy
from migd.policysim.workloads import pool_stream
nodes, policy = int(sys.argv[1]), sys.argv[2]
t0 = time.perf_counter()
jobs = pool_stream(nodes, 8)
t1 = time.perf_counter()
c1 = time.process_time()
result = simulate(jobs, named_policy(policy), PolicySimConfig(gpus=8, nodes=nodes))
c2 = time.process_time()
t2 = time.perf_counter()
m = compute_metrics(result)
print(json.dumps({
    "jobs": len(jobs), "build_s": t1 - t0, "sim_s": t2 - t1, "sim_cpu_s": c2 - c1,
    "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "completed": m.completed, "events": result.events,
    "throughput_per_h": m.throughput_per_h, "turnaround_p50_s": m.turnaround_p50_s,
}), flush=True)
# Freeing the run's heap object by object (370 MiB at 1,000 nodes: about 4 s here) is
# no part of a simulation: the child leaves once it has reported.
os._exit(0)
"""


def run_once(nodes: int, policy: str) -> dict[str, float]:
    load = os.getloadavg()[0]
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(nodes), policy],
        check=True,
        capture_output=True,
        text=True,
    )
    data: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    data["load"] = load
    return data


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--policy", default="migd")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--machine",
        default=f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
        help="the machine, in words, for the results",
    )
    args = parser.parse_args(argv)
    rows = []
    for nodes in (int(x) for x in args.sizes.split(",")):
        runs = []
        for _ in range(args.runs):
            started = time.perf_counter()
            data = run_once(nodes, args.policy)
            data["wall_s"] = time.perf_counter() - started
            runs.append(data)
            print(nodes, json.dumps(data), file=sys.stderr)
        rows.append((nodes, runs))
    lines = [
        "# Pool-scale simulation",
        "",
        f"Made by `.venv/bin/python bench/pool_scale.py --runs {args.runs} --policy "
        f"{args.policy}`: a simulated day of `pool_stream` (half [Voigtlaender]'s small "
        "trainings, half [MIG-HT]'s buckets 4:1:1:1, 20 users, 12 jobs per GPU per day, "
        "runtimes scaled to offered load 0.7) on nodes of 8 A100-40GB behind the "
        "HTCondor-like matcher, each run in a fresh process. *wall* is the whole "
        "process (start-up, building the stream, simulating, the metrics; it then leaves "
        "without freeing its heap); *sim* the simulation "
        "alone; *sim CPU* its CPU time (`time.process_time`), the figure to compare on a "
        "shared machine; *peak RSS* the process's `ru_maxrss`. Median of the runs; the "
        "load average (1 min) at each run's start shows how busy the machine was.",
        "",
        f"Machine: {args.machine}.",
        "",
        "| nodes | GPUs | jobs | events | sim CPU (s) | wall (s) | sim (s) | peak RSS (MiB) "
        "| completed | load avg | runs (sim CPU s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for nodes, runs in rows:
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        loads = ", ".join(f"{r['load']:.1f}" for r in runs)
        cpus = ", ".join(f"{r['sim_cpu_s']:.1f}" for r in runs)
        lines.append(
            f"| {nodes} | {nodes * 8} | {int(med['jobs'])} | {int(med['events'])} "
            f"| {med['sim_cpu_s']:.1f} | {med['wall_s']:.1f} | {med['sim_s']:.1f} "
            f"| {med['maxrss_mib']:.0f} "
            f"| {int(med['completed'])} | {loads} | {cpus} |"
        )
    lines.append("")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"pool_scale_{args.policy}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
