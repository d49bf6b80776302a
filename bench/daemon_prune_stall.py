"""The client's lease latency at saturation while the daemon prunes its history early
(issue 26 §4): what a prune held the event loop for shows in the tail.

Each tree's daemon (bench/daemon_vs_presplit.py's TreeDaemon, its own ``.venv``) keeps
``--keep`` history rows (``daemon.history_keep``; 100,000 by default, smaller here so a
run passes it several times: a lease writes three rows, and the housekeeping round every
10 s prunes early once the history is half again over it). 50 connections then lease and
release with 1-10 ms holds (``--paced``: 0.1-0.4 s), ``--cycles`` each; the trees take
turns, ``--rounds`` times.
Printed per tree: the pooled client latency p50 / p99 / p99.9 / max of leases granted
at once.

    .venv/bin/python bench/daemon_prune_stall.py . /tmp/old
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from bench_daemon import pct, run_async_clients  # noqa: E402
from daemon_vs_presplit import TreeDaemon  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", type=Path, nargs="+")
    parser.add_argument("--keep", type=int, default=20_000)
    parser.add_argument("--cycles", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--paced", action="store_true", help="holds of 0.1-0.4 s (about 200 leases/s)"
    )
    args = parser.parse_args()
    extra = ("--set", f"daemon.history_keep={args.keep}")
    times: dict[Path, list[float]] = {tree: [] for tree in args.trees}
    walls: dict[Path, float] = dict.fromkeys(args.trees, 0.0)
    for n in range(args.rounds):
        order = args.trees if n % 2 == 0 else list(reversed(args.trees))
        for tree in order:
            with TreeDaemon(tree.resolve(), extra=extra) as daemon:
                got, _prepared, wall = run_async_clients(
                    daemon.socket,
                    50,
                    args.cycles,
                    hold_s=(0.1, 0.4) if args.paced else (0.001, 0.01),
                )
            times[tree] += got
            walls[tree] += wall
            print(f"round {n + 1}: {tree} {len(got)} leases in {wall:.1f} s", flush=True)
    print(
        f"\n{args.rounds} rounds of 50 clients x {args.cycles} cycles"
        f"{' (paced)' if args.paced else ''}, history_keep "
        f"{args.keep}, {time.strftime('%Y-%m-%d %H:%M')}\n"
    )
    print("| tree | leases | cycles/s | p50 ms | p99 ms | p99.9 ms | max ms |")
    print("|---|---|---|---|---|---|---|")
    for tree, got in times.items():
        print(
            f"| {tree} | {len(got)} | {len(got) / walls[tree]:.0f} | {pct(got, 0.5):.2f} | "
            f"{pct(got, 0.99):.2f} | {pct(got, 0.999):.1f} | {max(got) * 1000:.1f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
