"""Saturation CPU per lease->release cycle of several trees, paired round by round.

bench/daemon_vs_presplit.py runs the paced and the saturation phases and reports each
tree's medians; on a machine whose speed drifts by 25 % within minutes that hides a
difference of a few percent. This runs the saturation phase only (50 clients, 40
cycles each after 4 warm-up cycles, a fresh daemon per run, as there), alternating the
order each round, and reports each tree's CPU per cycle against the last tree's *in the
same round*, as the median of those ratios with their range.

    .venv/bin/python bench/daemon_paired.py --rounds 6 /path/to/tree-a /tmp/presplit

Each tree needs its own ``.venv`` (a link to this one works: ``-m migd`` imports the
tree's own ``migd`` from its working directory). bench/patches/ has the experiments
bench/results/daemon_vs_presplit.md reports (apply one to a worktree).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from bench_daemon import run_async_clients  # noqa: E402
from daemon_vs_presplit import TreeDaemon, cpu_s  # noqa: E402


def saturation(tree: Path) -> tuple[float, float, float]:
    """(CPU ms per cycle, of which the event loop's thread, cycles per second)."""
    with TreeDaemon(tree) as daemon:
        run_async_clients(daemon.socket, 50, 4)  # instances made; warm
        pid = daemon.proc.pid
        before, loop_before = cpu_s(pid), cpu_s(pid, pid)
        times, made, seconds = run_async_clients(daemon.socket, 50, 40)
        cycles = len(times) + len(made)
        used, loop_used = cpu_s(pid) - before, cpu_s(pid, pid) - loop_before
    return used / cycles * 1000, loop_used / cycles * 1000, cycles / seconds


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", type=Path, nargs="+", help="the last is the reference")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    trees: list[Path] = [t.resolve() for t in args.trees]
    runs: dict[Path, list[tuple[float, float, float]]] = {t: [] for t in trees}
    for n in range(args.rounds):
        for tree in trees if n % 2 == 0 else list(reversed(trees)):
            runs[tree].append(saturation(tree))
        print(
            f"round {n + 1}: "
            + " | ".join(
                f"{t.name}: {runs[t][-1][0]:.2f} ms ({runs[t][-1][1]:.2f} loop), "
                f"{runs[t][-1][2]:.0f}/s"
                for t in trees
            ),
            flush=True,
        )
    reference = trees[-1]
    for tree in trees:
        cpu = [a[0] / b[0] for a, b in zip(runs[tree], runs[reference], strict=True)]
        loop = [a[1] / b[1] for a, b in zip(runs[tree], runs[reference], strict=True)]
        print(
            f"{tree}: CPU per cycle {statistics.median(r[0] for r in runs[tree]):.2f} ms; "
            f"against {reference.name} round by round: CPU {statistics.median(cpu):.3f} "
            f"({min(cpu):.2f}-{max(cpu):.2f}), loop thread {statistics.median(loop):.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
