"""Benchmark the partition core: precompute cost per model, planning latency on 8-GPU nodes.

Targets (issue "partition core"): every model, +me included, precomputed in under 1 s and
under 50 MB; placement p99 under 1 ms and a fission plan p99 under 20 ms on random node
states with 8 GPUs.

    .venv/bin/python bench/bench_core.py [--samples 2000] [--out bench/results/core.md]

Each model is precomputed in a fresh subprocess so the time includes nothing cached and
the memory figure is that process's peak Python allocation (tracemalloc) and RSS growth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from migd.core import catalog  # noqa: E402
from migd.core.planner import (  # noqa: E402
    GpuView,
    Instance,
    PartitionRequest,
    plan_on_gpu,
    plan_on_node,
)
from migd.core.states import state_space  # noqa: E402
from migd.errors import NoCapacity, RequestTooLarge  # noqa: E402

CHILD = """
import json, resource, sys, time, tracemalloc
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
from migd.core import catalog
from migd.core.states import StateSpace
geo = catalog.geometry(sys.argv[1])
profiles = geo.profile_set(sys.argv[2])
t = time.perf_counter()
space = StateSpace(geo, profiles)  # timed without tracemalloc, which slows allocation
elapsed = time.perf_counter() - t
tracemalloc.start()
StateSpace(geo, profiles)
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"states": len(space), "full": len(space.full_states), "seconds": elapsed,
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


def random_view(index: int, rng: random.Random, model: str = "A100-40GB") -> GpuView:
    space = state_space(catalog.geometry(model))
    key = 0
    for _ in range(rng.randint(0, 8)):
        atom = rng.choice(space.atoms)
        if space.can_allocate(key, atom):
            key |= 1 << atom.index
    instances = tuple(
        Instance(a.profile, a.start, rng.random() < 0.6) for a in space.placements(key)
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


def planning_latency(samples: int, seed: int = 1) -> dict[str, dict[str, float]]:
    rng = random.Random(seed)
    node_times: list[float] = []
    fission_times: list[float] = []
    sizes = [4000, 9000, 9500, 19000, 20000, 40000]
    while len(node_times) < samples or len(fission_times) < samples:
        views = [random_view(i, rng) for i in range(8)]
        request = PartitionRequest(rng.choice(sizes))
        t = time.perf_counter()
        with contextlib.suppress(NoCapacity, RequestTooLarge):
            plan_on_node(views, request)
        node_times.append(time.perf_counter() - t)
        # a fission/fusion plan: a GPU where the profile does not fit in free slices
        view = views[0]
        for profile in view.space.profiles:
            if not view.space.legal_starts(view.key, profile):
                t = time.perf_counter()
                decision = plan_on_gpu(view, profile)
                elapsed = time.perf_counter() - t
                if decision is not None and decision.action == "repartition":
                    fission_times.append(elapsed)
                break
    return {
        "node placement (8 GPUs)": percentiles(node_times[:samples]),
        "fission/fusion plan (1 GPU)": percentiles(fission_times[:samples]),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = precompute_table()
    lat = planning_latency(args.samples)
    lines = [
        "# Partition core benchmark",
        "",
        f"`{' '.join(['.venv/bin/python', 'bench/bench_core.py', *sys.argv[1:]])}` on "
        f"{os.cpu_count()} cores, "
        f"Python {sys.version.split()[0]}.",
        "",
        "## Precompute per model (fresh process each)",
        "",
        "| model | profile set | states | full | time (ms) | peak alloc (MiB) | RSS growth (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['profiles']} | {r['states']} | {r['full']} | "
            f"{float(r['seconds']) * 1000:.1f} | {float(r['peak_mib']):.2f} | "
            f"{float(r['rss_growth_mib']):.1f} |"
        )
    worst_t = max(float(r["seconds"]) for r in rows)
    worst_m = max(float(r["peak_mib"]) for r in rows)
    lines += [
        "",
        f"Worst: {worst_t * 1000:.1f} ms, {worst_m:.2f} MiB peak allocation "
        "(targets: < 1 s, < 50 MB).",
        "",
        "## Planning latency (random states, 60 % of instances busy)",
        "",
        "| operation | n | p50 (ms) | p99 (ms) | max (ms) |",
        "|---|---|---|---|---|",
    ]
    for name, p in lat.items():
        lines.append(
            f"| {name} | {p['n']} | {p['p50_ms']:.3f} | {p['p99_ms']:.3f} | {p['max_ms']:.3f} |"
        )
    lines.append("")
    lines.append("Targets: placement p99 < 1 ms, fission plan p99 < 20 ms.")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
