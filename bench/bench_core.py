"""Benchmark the partition core: precompute cost per model, planning latency on 8-GPU nodes.

Targets (issue "partition core"): every model, +me included, precomputed in under 1 s and
under 50 MB; placement p99 under 1 ms and a fission plan p99 under 20 ms on random node
states with 8 GPUs.

    .venv/bin/python bench/bench_core.py [--samples 2000] [--out bench/results/core.md]

Each model is precomputed in a fresh subprocess so the time includes nothing cached and
the memory figure is that process's peak Python allocation (tracemalloc) and RSS growth.
Every figure is given as wall time and as CPU time (``time.process_time``) of this
process: on a shared machine the wall time includes waiting for a core, the CPU time
does not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from migd.core import catalog  # noqa: E402
from migd.core.planner import (  # noqa: E402
    Decision,
    GpuView,
    Instance,
    PartitionRequest,
    plan_on_node,
)
from migd.core.states import StateSpace, state_space  # noqa: E402
from migd.errors import NoCapacity, RequestTooLarge  # noqa: E402

CHILD = """
import json, resource, sys, time, tracemalloc
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
from migd.core import catalog
from migd.core.states import StateSpace
geo = catalog.geometry(sys.argv[1])
profiles = geo.profile_set(sys.argv[2])
c, t = time.process_time(), time.perf_counter()
space = StateSpace(geo, profiles)  # timed without tracemalloc, which slows allocation
elapsed, cpu = time.perf_counter() - t, time.process_time() - c
tracemalloc.start()
StateSpace(geo, profiles)
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"states": len(space), "full": len(space.full_states), "seconds": elapsed,
                  "cpu_seconds": cpu,
                  "peak_mib": peak / 2**20, "rss_growth_mib": (rss1 - rss0) / 1024}))
"""


def precompute_table() -> list[dict[str, object]]:
    rows = []
    for model in catalog.model_names():
        for option in ("standard", "media", "all"):
            out = subprocess.run(
                [sys.executable, "-c", CHILD, model, option],
                capture_output=True,
                text=True,
                check=True,
                cwd=ROOT,
            )
            rows.append({"model": model, "profiles": option, **json.loads(out.stdout)})
    return rows


def random_layout(space: StateSpace, rng: random.Random, *, packed: bool) -> int:
    """A random valid layout: a few random allocations, or allocations until full."""
    key = 0
    tries = 64 if packed else rng.randint(0, 8)
    for _ in range(tries):
        room = [a for a in space.atoms if space.can_allocate(key, a)] if packed else space.atoms
        if not room:
            break
        atom = rng.choice(room)
        if space.can_allocate(key, atom):
            key |= 1 << atom.index
    return key


def random_view(
    index: int, rng: random.Random, space: StateSpace, *, packed: bool = False, busy: float = 0.6
) -> GpuView:
    key = random_layout(space, rng, packed=packed)
    instances = tuple(
        Instance(a.profile, a.start, rng.random() < busy) for a in space.placements(key)
    )
    return GpuView(index, space, instances)


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples_s)
    return {
        "p50_ms": statistics.median(ms),
        "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
        "max_ms": ms[-1],
        "n": len(ms),
    }


def timed(fn: Callable[[], Decision]) -> tuple[float, float, Decision | None]:
    """(wall s, CPU s, result) of one call; planning errors count as a result of None."""
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        result: Decision | None = fn()
    except (NoCapacity, RequestTooLarge):
        result = None
    return time.perf_counter() - t0, time.process_time() - c0, result


SCENARIOS: dict[str, tuple[list[str], str]] = {
    "8 x A100-40GB, standard": (["A100-40GB"], "standard"),
    "8 x A100-40GB, +me (media)": (["A100-40GB"], "media"),
    "8 GPUs of mixed models, standard": (list(catalog.model_names()), "standard"),
    "8 GPUs of mixed models, +me (media)": (list(catalog.model_names()), "media"),
}


def planning_latency(samples: int, seed: int = 1) -> list[dict[str, Any]]:
    """Placement on random 8-GPU nodes and fission plans on packed ones, per scenario.

    *Placement*: each GPU a few random allocations, 60 % of instances busy; a random
    request size. *Fission*: each GPU filled until nothing fits, a random 25-75 % of
    instances busy, a random profile size; a sample counts when the node's decision
    is a repartition (the planner priced every GPU's repartitions to get there).
    """
    rows = []
    for name, (models, option) in SCENARIOS.items():
        rng = random.Random(seed)
        spaces = [state_space(catalog.geometry(m), option) for m in models]
        sizes = sorted({p.memory_mib for s in spaces for p in s.profiles})
        place_wall: list[float] = []
        place_cpu: list[float] = []
        fission_wall: list[float] = []
        fission_cpu: list[float] = []
        attempts = 0
        while len(place_wall) < samples or len(fission_wall) < samples:
            views = [random_view(i, rng, rng.choice(spaces)) for i in range(8)]
            request = PartitionRequest(rng.choice(sizes))
            if len(place_wall) < samples:
                wall, cpu, _ = timed(lambda v=views, r=request: plan_on_node(v, r))
                place_wall.append(wall)
                place_cpu.append(cpu)
            attempts += 1
            if len(fission_wall) >= samples or attempts > 200 * samples:
                continue
            busy = rng.uniform(0.25, 0.75)
            packed = [
                random_view(i, rng, rng.choice(spaces), packed=True, busy=busy) for i in range(8)
            ]
            fission = PartitionRequest(rng.choice(sizes))
            wall, cpu, decision = timed(lambda v=packed, r=fission: plan_on_node(v, r))
            if decision is not None and decision.action == "repartition":
                fission_wall.append(wall)
                fission_cpu.append(cpu)
        rows.append(
            {
                "scenario": name,
                "placement": percentiles(place_wall),
                "placement_cpu": percentiles(place_cpu),
                "fission": percentiles(fission_wall),
                "fission_cpu": percentiles(fission_cpu),
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    rows = precompute_table()
    lat = planning_latency(args.samples)
    lines = [
        "# Partition core benchmark",
        "",
        f"`{' '.join(['.venv/bin/python', 'bench/bench_core.py', *sys.argv[1:]])}` on "
        f"{os.cpu_count()} cores (1-minute load {load:.1f} at the start), "
        f"Python {sys.version.split()[0]}.",
        "",
        "## Precompute per model (fresh process each)",
        "",
        "| model | profile set | states | full | wall (ms) | CPU (ms) | peak alloc (MiB) "
        "| RSS growth (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['profiles']} | {r['states']} | {r['full']} | "
            f"{float(r['seconds']) * 1000:.1f} | {float(r['cpu_seconds']) * 1000:.1f} | "
            f"{float(r['peak_mib']):.2f} | {float(r['rss_growth_mib']):.1f} |"
        )
    worst_t = max(float(r["seconds"]) for r in rows)
    worst_c = max(float(r["cpu_seconds"]) for r in rows)
    worst_m = max(float(r["peak_mib"]) for r in rows)
    lines += [
        "",
        f"Worst: {worst_t * 1000:.1f} ms wall, {worst_c * 1000:.1f} ms CPU, {worst_m:.2f} MiB "
        "peak allocation (targets: < 1 s, < 50 MB).",
        "",
        "## Planning latency on 8-GPU nodes",
        "",
        "Placement: each GPU a few random allocations, 60 % of the instances busy, a random",
        "request size. Fission: every GPU filled until nothing fits, 25-75 % of instances",
        "busy, a random request size; only requests the node answers with a repartition",
        "count. Mixed nodes draw each GPU's model from all built-in models.",
        "",
        "| scenario | operation | n | p50 wall (ms) | p99 wall (ms) | max wall (ms) "
        "| p50 CPU (ms) | p99 CPU (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in lat:
        for op, key in (("placement", "placement"), ("fission/fusion plan", "fission")):
            w, c = row[key], row[f"{key}_cpu"]
            lines.append(
                f"| {row['scenario']} | {op} | {w['n']} | {w['p50_ms']:.3f} | {w['p99_ms']:.3f} "
                f"| {w['max_ms']:.3f} | {c['p50_ms']:.3f} | {c['p99_ms']:.3f} |"
            )
    worst_place = max(row["placement"]["p99_ms"] for row in lat)
    worst_fission = max(row["fission"]["p99_ms"] for row in lat)
    lines += [
        "",
        f"Worst p99: placement {worst_place:.3f} ms, fission plan {worst_fission:.3f} ms "
        "(targets: < 1 ms, < 20 ms).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
