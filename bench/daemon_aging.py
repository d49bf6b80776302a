"""Paced client latency of long-lived daemons: several trees' daemons side by side, each
taking 8,000 saturating lease->release cycles per stage, then 3 paced rounds (50
clients, 0.1-0.4 s holds, 10 cycles each): the client p50/p99 of leases granted at
once, the daemon's RSS and its state db's size (WAL included), stage by stage.

    .venv/bin/python bench/daemon_aging.py --stages 5 . /tmp/presplit

bench/daemon_alternating.py's paced figure on fresh daemons hides what a daemon that has
served tens of thousands of cycles does; this shows it. Each tree needs its own
``.venv`` (a link to this one works).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from bench_daemon import pct, rss_mib, run_async_clients  # noqa: E402
from daemon_vs_presplit import TreeDaemon  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", type=Path, nargs="+")
    parser.add_argument("--stages", type=int, default=5)
    args = parser.parse_args()
    trees: list[Path] = [t.resolve() for t in args.trees]
    daemons = {t: TreeDaemon(t).__enter__() for t in trees}
    try:
        for stage in range(args.stages):
            for tree in trees:
                run_async_clients(daemons[tree].socket, 50, 160)  # 8,000 cycles
            cells = []
            for tree in trees:
                daemon = daemons[tree]
                latencies: list[float] = []
                for _ in range(3):
                    times, _, _ = run_async_clients(daemon.socket, 50, 10, hold_s=(0.1, 0.4))
                    latencies += times
                db = sum(f.stat().st_size for f in (daemon.root / "state").glob("migd.db*"))
                cells.append(
                    f"{tree.name}: p99 {pct(latencies, 0.99):.1f} ms, p50 "
                    f"{pct(latencies, 0.5):.1f} ms, RSS {rss_mib(daemon.proc.pid)[0]:.0f} MiB, "
                    f"db {db / 1e6:.0f} MB"
                )
            print(f"after {(stage + 1) * 8000} cycles: " + " | ".join(cells), flush=True)
    finally:
        for daemon in daemons.values():
            daemon.__exit__(None, None, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
